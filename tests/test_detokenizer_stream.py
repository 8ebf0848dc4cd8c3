"""The detokenizer's two paths release the same text: the `tokenizers` DecodeStream
path (fast tokenizers) and the Python offset path (slow tokenizers, options the
backend cannot honour, a stream that fails), chunk by chunk, on random id
sequences of the default model's tokenizer, multi-byte characters split across
tokens included, with and without special tokens and stop strings."""

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


@pytest.fixture(scope="module")
def byte_ids(tokenizer: Any) -> list[int]:
    """Ids of tokens that are pieces of multi-byte characters (a lone UTF-8 byte, or a
    few), so random sequences split characters across tokens."""
    texts = ["😀", "🎉", "日本語", "à", "€", "👩‍👩‍👧", "中文", "✓", "e\u0301", "ß"]
    ids = {i for t in texts for i in tokenizer.encode(t, add_special_tokens=False)}
    return sorted(i for i in ids if "\ufffd" in tokenizer.decode([i]))


def make(tokenizer: Any, fast: bool) -> Detokenizer:
    d = Detokenizer(tokenizer, None, None)  # type: ignore[arg-type]
    if fast:
        assert d.backend is not None, "the default model's tokenizer is a fast one"
    else:
        d.backend = None  # what a slow tokenizer gets: the offset path alone
    return d


def run(detok: Detokenizer, seqs: list[list[int]], step: int, skip: bool = True, spaces: bool = True,
        stops: list[str] | None = None, no_stop_trim: bool = False) -> list[list[str]]:
    """Stream every sequence at once, `step` ids per batch each: every request's chunks."""
    n = len(seqs)
    chunks: list[list[str]] = [[] for _ in seqs]
    done = [False] * n
    for start in range(0, max(map(len, seqs)) + 1, step):
        live = [i for i in range(n) if not done[i]]
        if not live:
            break
        fins: list[Any] = []
        for i in live:
            last = start + step >= len(seqs[i])
            done[i] = last
            fins.append({"type": "length", "length": len(seqs[i])} if last else None)
        k = len(live)
        b = BatchTokenIDOutput([f"r{i}" for i in live], [seqs[i][start : start + step] for i in live], fins,
                               [1] * k, [start + step] * k, [0] * k, [skip] * k, [spaces] * k, [no_stop_trim] * k,
                               [stops or []] * k, [True] * k, [None] * k)
        for i, text in zip(live, detok.process(b).texts):
            chunks[i].append(text)
    assert detok.states == {}
    return chunks


def ids_strategy(tokenizer: Any, byte_ids: list[int]) -> st.SearchStrategy[list[int]]:
    vocab = len(tokenizer)
    one = st.one_of(st.integers(0, vocab - 1), st.sampled_from(byte_ids), st.sampled_from(byte_ids),
                    st.integers(0, 16))  # 0..16: the special tokens
    return st.lists(one, min_size=1, max_size=48)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), step=st.integers(1, 4), skip=st.booleans(), n=st.integers(1, 4))
def test_both_paths_give_the_same_chunks_on_random_ids(tokenizer: Any, byte_ids: list[int], data: st.DataObject,
                                                       step: int, skip: bool, n: int) -> None:
    seqs = [data.draw(ids_strategy(tokenizer, byte_ids)) for _ in range(n)]
    fast = run(make(tokenizer, True), seqs, step, skip=skip)
    slow = run(make(tokenizer, False), seqs, step, skip=skip)
    assert fast == slow
    for ids, chunks in zip(seqs, fast):
        assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40),
       step=st.integers(1, 3), stop=st.text(min_size=1, max_size=3), spaces=st.booleans())
def test_both_paths_agree_on_text_with_stop_strings(tokenizer: Any, text: str, step: int, stop: str,
                                                    spaces: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        return
    fast = run(make(tokenizer, True), [ids], step, spaces=spaces, stops=[stop])
    slow = run(make(tokenizer, False), [ids], step, spaces=spaces, stops=[stop])
    assert fast == slow
    assert "".join(fast[0]) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", ["Bonjour à tous 😀🎉!", "日本語のテキスト", "e\u0301 combining", "👩‍👩‍👧 family"])
def test_multibyte_characters_split_across_tokens(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.isascii() or "e\u0301" in text
    fast = run(make(tokenizer, True), [ids], 1)
    assert fast == run(make(tokenizer, False), [ids], 1)
    assert "".join(fast[0]) == text and not any("\ufffd" in c for c in fast[0])


def test_the_fast_path_is_taken_and_a_failing_stream_falls_back(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello there, 日本語 😀 world", add_special_tokens=False)
    detok = make(tokenizer, True)
    half = len(ids) // 2
    b = BatchTokenIDOutput(["r"], [ids[:half]], [None], [1], [half], [0], [True], [True], [False], [[]], [True],
                           [None])
    first = detok.process(b).texts[0]
    assert detok.states["r"].stream is not None

    class Broken:
        def step(self, tokenizer: Any, ids: Any) -> str:
            raise RuntimeError("boom")

    detok.states["r"].stream = Broken()
    b = BatchTokenIDOutput(["r"], [ids[half:-1]], [None], [1], [len(ids)], [0], [True], [True], [False], [[]],
                           [True], [None])
    second = detok.process(b).texts[0]
    assert detok.states["r"].stream is None  # the offset path from here on
    b = BatchTokenIDOutput(["r"], [ids[-1:]], [{"type": "length", "length": len(ids)}], [1], [len(ids)], [0], [True],
                           [True], [False], [[]], [True], [None])
    assert first + second + detok.process(b).texts[0] == "Hello there, 日本語 😀 world"


class CleaningTokenizer:
    """A fast tokenizer whose decode cleans up spaces (as transformers may): its backend
    alone would decode differently, so the detokenizer must not stream through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._tokenizer = inner._tokenizer
        self.all_special_ids = inner.all_special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens).replace(" .", ".").replace(" ,", ",")


def test_a_tokenizer_the_backend_does_not_match_keeps_the_offset_path(tokenizer: Any) -> None:
    tok = CleaningTokenizer(tokenizer)
    detok = Detokenizer(tok, None, None)  # type: ignore[arg-type]
    assert detok.backend is not None
    ids = tokenizer.encode("One , two . three", add_special_tokens=False)
    b = BatchTokenIDOutput(["r"], [ids[:2]], [None], [1], [2], [0], [True], [True], [False], [[]], [True], [None])
    detok.process(b)
    assert detok.states["r"].stream is None
    b = BatchTokenIDOutput(["r"], [ids[2:]], [{"type": "length", "length": len(ids)}], [1], [len(ids)], [0], [True],
                           [True], [False], [[]], [True], [None])
    detok.process(b)
    assert detok.states == {}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), step=st.integers(2, 4))
def test_a_step_that_takes_no_list_goes_one_id_at_a_time(tokenizer: Any, byte_ids: list[int], data: st.DataObject,
                                                         step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Older tokenizers' DecodeStream.step takes one id: the same text comes out, only
    split differently within a batch."""
    from tokenizers.decoders import DecodeStream

    class OneIdStream:
        def __init__(self, skip_special_tokens: bool) -> None:
            self.inner = DecodeStream(skip_special_tokens=skip_special_tokens)

        def step(self, tokenizer: Any, token_id: Any) -> str | None:
            if not isinstance(token_id, int):
                raise TypeError("argument 'id': 'list' object cannot be interpreted as an integer")
            return self.inner.step(tokenizer, token_id)

    monkeypatch.setattr("sgl.runtime.detokenizer.DecodeStream", OneIdStream)
    seqs = [data.draw(ids_strategy(tokenizer, byte_ids)) for _ in range(3)]
    detok = make(tokenizer, True)
    fast = run(detok, seqs, step)
    assert not detok._list_steps or max(map(len, seqs)) <= step  # no batch before the last
    slow = run(make(tokenizer, False), seqs, step)
    assert ["".join(c) for c in fast] == ["".join(c) for c in slow]
    assert ["".join(c) for c in fast] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in seqs]


@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.data())
def test_joined_chunks_equal_their_concatenation(ids: list[int], data: st.DataObject) -> None:
    """Chunks a reader fell behind on, joined in turn (sgl.runtime.result_format.join_chunks),
    hold what the chunks hold together: texts, ids and logprob lists concatenated, the
    other fields as the last one has them."""
    from sgl.runtime.result_format import join_chunks

    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=len(ids) - 1)) if len(ids) > 1 else set())
    bounds = [0, *cuts, len(ids)]
    chunks = [{"text": "".join(chr(97 + t % 26) for t in ids[a:b]), "output_ids": ids[a:b],
               "meta_info": {"completion_tokens": b, "finish_reason": None if b < len(ids) else {"type": "length"},
                             "output_token_logprobs": [(-1.0, t, None) for t in ids[a:b]],
                             "input_token_logprobs": [(None, 1, None)] if a == 0 else []}}
              for a, b in zip(bounds, bounds[1:])]
    joined = chunks[0]
    for later in chunks[1:]:
        joined = join_chunks(joined, later)
    assert joined["output_ids"] == ids and joined["text"] == "".join(chr(97 + t % 26) for t in ids)
    m = joined["meta_info"]
    assert m["completion_tokens"] == len(ids) and m["finish_reason"] == {"type": "length"}
    assert [t for _, t, _ in m["output_token_logprobs"]] == ids and m["input_token_logprobs"] == [(None, 1, None)]
