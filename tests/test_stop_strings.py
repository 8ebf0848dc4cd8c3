"""Stop strings apply only to the text produced after min_new_tokens, and the result
is trimmed at the occurrence that stopped generation, streamed or not, as vLLM does:
an occurrence counts when it ends in the text of the newest token.

On the default model: "1, 2, 3," continues " 4, 5, 6, ..." with a comma every third
token, so a comma stop with min_new_tokens must skip the early commas and keep them
in the text."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

import sgl
from sgl.core.stop_rule import earliest_ending_after, earliest_regex_ending_after, stop_cut

PROMPT = "Count from one to twenty: 1, 2, 3,"


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    with sgl.Engine(transport="inproc") as e:
        yield e


@pytest.fixture(scope="module")
def base(engine: sgl.Engine) -> list[int]:
    return engine.generate(PROMPT, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})["output_ids"]


@pytest.mark.parametrize("min_new", [0, 1, 3, 4, 6])
def test_stop_string_after_min_new_tokens_trims_at_the_stopping_occurrence(
        engine: sgl.Engine, base: list[int], min_new: int) -> None:
    tok = engine.tokenizer
    # The first comma token at or past min_new tokens stops it (tokens before are masked from stopping).
    stop_at = next(j for j, t in enumerate(base) if j >= min_new and tok.decode([t]) == ",")
    expected = tok.decode(base[:stop_at])
    sp = {"max_new_tokens": 24, "temperature": 0, "stop": ",", "min_new_tokens": min_new}
    out = engine.generate(PROMPT, sp)
    streamed = "".join(c["text"] for c in engine.generate(PROMPT, sp, stream=True))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}
    assert out["meta_info"]["completion_tokens"] == stop_at + 1
    assert out["text"] == expected
    assert streamed == expected
    assert expected.count(",") == sum(tok.decode([t]) == "," for t in base[:stop_at])  # the early commas stay


def test_no_stop_trim_keeps_the_stop_string(engine: sgl.Engine, base: list[int]) -> None:
    sp = {"max_new_tokens": 24, "temperature": 0, "stop": ",", "min_new_tokens": 3, "no_stop_trim": True}
    out = engine.generate(PROMPT, sp)
    assert out["text"] == engine.tokenizer.decode(base[: out["meta_info"]["completion_tokens"]])
    assert out["text"].endswith(",") and out["text"].count(",") == 2


def test_the_rule_counts_only_occurrences_ending_in_new_text() -> None:
    text = "a,b,c,d"
    assert earliest_ending_after(text, [","], len("a,b,c")) == ","
    assert earliest_ending_after(text, [","], len(text)) is None
    # A stop string straddling old and new text counts; the earliest occurrence wins.
    assert earliest_ending_after(text, ["c,", ",d"], len("a,b,c")) == "c,"
    assert stop_cut(text, ",", len("a,b,c")) == 5
    assert stop_cut(text, ",", len(text)) == 5  # none ends after: the last one
    assert stop_cut("abc", ",", 1) == -1


def test_a_regex_stop_after_min_new_tokens_trims_at_its_match(engine: sgl.Engine, base: list[int]) -> None:
    """SGLang's stop_regex: the first match ending in new text past min_new_tokens stops and trims."""
    tok = engine.tokenizer
    full = tok.decode(base)
    sp = {"max_new_tokens": 24, "temperature": 0, "stop_regex": r"[0-9], [0-9],", "min_new_tokens": 3}
    out = engine.generate(PROMPT, sp)
    fin = out["meta_info"]["finish_reason"]
    assert fin["type"] == "stop" and re.fullmatch(r"[0-9], [0-9],", fin["matched"])
    assert full.startswith(out["text"] + fin["matched"])
    assert out["text"] + fin["matched"] == tok.decode(base[: out["meta_info"]["completion_tokens"]])


def test_the_regex_rule_and_its_time_bound() -> None:
    assert earliest_regex_ending_after("a1b22c333", [r"[0-9]+"], len("a1b2")) == "22"
    assert earliest_regex_ending_after("a1b22c333", [r"[0-9]+"], len("a1b22c333")) is None
    assert earliest_regex_ending_after("xyz", [r"q", r"y"], 1) == "y"
    with pytest.raises(TimeoutError):
        earliest_regex_ending_after("a" * 40 + "!", [r"(a|aa)+$"], 0)
