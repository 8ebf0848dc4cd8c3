"""The tokenizer work the engine does for callers (sgl.runtime.tokenizer_ops): prompts
encode to the ids the tokenizer itself gives, whether its backend encodes them alone
(offsets skipped) or, for a tokenizer that works on texts in Python first, the tokenizer does."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl.runtime.tokenizer_ops import _offsetless_backend, encode


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from sgl.sched.models.default_model import default_model_dir
    from sgl.sched.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir())


def _pieces(tok: Any) -> st.SearchStrategy[str]:
    """Texts of any characters, with the tokenizer's special tokens and runs of spaces among them."""
    chars = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30)
    return st.lists(st.one_of(chars, st.sampled_from([*tok.all_special_tokens, " ", "  ", "\n\n", "\r\n"])),
                    max_size=6).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), add=st.booleans())
def test_prompts_encode_as_the_tokenizer_does(tokenizer: Any, data: st.DataObject, add: bool) -> None:
    assert _offsetless_backend(tokenizer) is not None  # the default model's backend encodes alone
    texts = data.draw(st.lists(_pieces(tokenizer), min_size=1, max_size=3))
    assert encode(tokenizer, texts, add) == [list(i) for i in tokenizer(texts, add_special_tokens=add)["input_ids"]]


class Lowercasing:
    """A tokenizer that changes texts in Python before its backend sees them."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self._tokenizer = tok._tokenizer
        self.all_special_tokens = tok.all_special_tokens

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> Any:
        return self.tok([t.lower() for t in texts], add_special_tokens=add_special_tokens)


def test_a_tokenizer_its_backend_disagrees_with_encodes_itself(tokenizer: Any) -> None:
    tok = Lowercasing(tokenizer)
    assert _offsetless_backend(tok) is None
    assert encode(tok, ["Hello World"], False) == [tokenizer.encode("hello world", add_special_tokens=False)]
