"""Incremental detokenization: streamed deltas add up to the full decode exactly,
and no delta shows a broken multi-byte character."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl.core.protocol import BatchTokenIDOutput
from sgl.runtime.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from sgl.sched.models.default_model import default_model_dir
    from sgl.sched.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir())


def _stream(detok: Detokenizer, rid: str, ids: list[int], step: int) -> list[str]:
    chunks = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        b = BatchTokenIDOutput([rid], [ids[i : i + step]], [{"type": "length", "length": len(ids)} if last else None],
                               [1], [i + step], [0], [True], [True], [False], [[]], [True], [None])
        chunks.append(detok.process(b).texts[0])
    return chunks


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40),
       step=st.integers(1, 3))
def test_stream_reassembles_any_text(tokenizer: Any, text: str, step: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        return
    detok = Detokenizer(tokenizer, None, None)  # type: ignore[arg-type]
    chunks = _stream(detok, "r", ids, step)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) == expected
    assert not any("\ufffd" in c for c in chunks[:-1]) or "\ufffd" in expected
    assert detok.states == {}  # finished requests are forgotten


@pytest.mark.parametrize("text", ["Bonjour à tous 😀🎉!", "日本語のテキスト", "e\u0301 combining", "👩‍👩‍👧 family"])
def test_multibyte_characters_split_across_tokens(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer, None, None)  # type: ignore[arg-type]
    chunks = _stream(detok, "r", ids, 1)
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)
