"""Reasoning models: the reasoning splitter (whole, streamed, any split of the output the
same: a Hypothesis property), the formats' rules (Qwen3's enable_thinking, DeepSeek-R1's
reasoning from the first token, no end marker), the reasoning token count; then through
a real `sgl serve` with the official openai client: `--reasoning-parser qwen3` on a
model whose tokenizer has `<think>` and `</think>` as tokens (SmolLM2's, two of its
unused special tokens renamed, with Qwen3's enable_thinking rule in its template; null
weights, the output scripted by force_tokens): message.reasoning_content, streamed
delta.reasoning_content before the content, reasoning_tokens in usage, tools read after
the reasoning, separate_reasoning=false, stream_reasoning=false, thinking off, and a
response_format grammar that applies after the end of the reasoning only."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.server.reasoning import FORMATS, ReasoningFormat, ReasoningSplitter, Split, format_of, reasoning_tokens
from tests.serve_util import ServerProc, openai_client

QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek-r1"]


def whole(fmt: ReasoningFormat, text: str, inside: bool = True, stream: bool = True) -> Split:
    return ReasoningSplitter(fmt, inside, stream).split(text)


def pieces(fmt: ReasoningFormat, chunks: list[str], inside: bool = True, stream: bool = True) -> list[Split]:
    s = ReasoningSplitter(fmt, inside, stream)
    return [s.feed(c) for c in chunks] + [s.finish()]


def joined(splits: list[Split]) -> Split:
    return Split("".join(s.reasoning for s in splits), "".join(s.content for s in splits))


CASES: list[tuple[ReasoningFormat, bool, str, Split]] = [
    # Qwen3, thinking on: <think> in the output, or already in the prompt.
    (QWEN3, True, "<think>\nLet me add.\n</think>\n\nIt is 4.", Split("Let me add.", "It is 4.")),
    (QWEN3, True, "Let me add.\n</think>\n\nIt is 4.", Split("Let me add.", "It is 4.")),
    # Thinking off: the template's empty block, or none at all.
    (QWEN3, False, "It is 4.", Split("", "It is 4.")),
    (QWEN3, False, "<think>\n\n</think>\n\nIt is 4.", Split("", "It is 4.")),
    (QWEN3, False, "  It is <think> 4.", Split("", "  It is <think> 4.")),
    # No end marker: the answer never started.
    (QWEN3, True, "<think>Still thinking", Split("Still thinking", "")),
    (QWEN3, True, "Still thinking </thi", Split("Still thinking </thi", "")),
    # DeepSeek-R1: reasoning from the first token, with or without <think>.
    (R1, True, "Hmm.</think>42", Split("Hmm.", "42")),
    (R1, True, "<think>Hmm.</think>42", Split("Hmm.", "42")),
    (R1, True, "</think>42", Split("", "42")),
    (R1, True, "Hmm. <think> again</think>42 </think>", Split("Hmm. <think> again", "42 </think>")),
    (ReasoningFormat("[THINK]", "[/THINK]"), True, "[THINK]a\n[/THINK]b", Split("a", "b")),
    (QWEN3, True, "", Split("", "")),
    (QWEN3, False, "", Split("", "")),
]


@pytest.mark.parametrize("fmt,inside,text,want", CASES)
def test_split_whole_and_by_character(fmt: ReasoningFormat, inside: bool, text: str, want: Split) -> None:
    assert whole(fmt, text, inside) == want
    assert joined(pieces(fmt, list(text), inside)) == want
    assert joined(pieces(fmt, list(text), inside, stream=False)) == want


def test_streamed_pieces_hold_only_a_partial_marker() -> None:
    got = pieces(QWEN3, ["<th", "ink>", "Let me ", "add. </th", "ink>", "\n\nIt", " is 4."])
    assert got == [Split("", ""), Split("", ""), Split("Let me", ""), Split(" add.", ""), Split("", ""),
                   Split("", "It"), Split("", " is 4."), Split("", "")]


def test_stream_reasoning_false_gives_it_whole_once_it_ends() -> None:
    got = pieces(QWEN3, ["<think>a", " b", "</think>c", "d"], stream=False)
    assert got == [Split("", ""), Split("", ""), Split("a b", "c"), Split("", "d"), Split("", "")]
    assert pieces(R1, ["a", " b"], stream=False) == [Split("", ""), Split("", ""), Split("a b", "")]


# Pieces that make markers, parts of markers and whitespace often.
TEXT = st.lists(st.sampled_from(["<", "/", ">", "t", "h", "i", "n", "k", " ", "\n", "x", "<think>", "</think>", "</th",
                                 "<|begin_of_thought|>", "<|end_of_thought|>", "<|end_of"]),
                max_size=30).map("".join)


@given(TEXT, st.lists(st.integers(0, 400), max_size=8), st.booleans(), st.booleans(),
       st.sampled_from([QWEN3, R1, ReasoningFormat("<|begin_of_thought|>", "<|end_of_thought|>")]))
def test_any_split_gives_the_whole(text: str, cuts: list[int], inside: bool, stream: bool,
                                   fmt: ReasoningFormat) -> None:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert joined(pieces(fmt, chunks, inside, stream)) == whole(fmt, text, inside)


def test_formats() -> None:
    assert QWEN3.starts_inside(None) and QWEN3.starts_inside({"enable_thinking": True})
    assert not QWEN3.starts_inside({"enable_thinking": False})
    assert R1.starts_inside({"enable_thinking": False})
    assert format_of(None) is None and format_of("qwen3") is QWEN3
    assert format_of("generic", ["<r>", "</r>"]) == ReasoningFormat("<r>", "</r>")


def test_reasoning_tokens() -> None:
    assert reasoning_tokens([7, 1, 2, 3, 8, 4, 5], [7], [8], inside=False) == 3
    assert reasoning_tokens([1, 2, 8, 4], [7], [8], inside=True) == 2
    assert reasoning_tokens([1, 2, 8, 4], [7], [8], inside=False) == 0
    assert reasoning_tokens([7, 1, 2], [7], [8], inside=False) == 2  # never ended
    assert reasoning_tokens([1, 2, 9, 8, 4], [7], [9, 8], inside=True) == 2  # a marker of two tokens


def test_server_args() -> None:
    markers = ["<r>", "</r>"]
    assert ServerArgs(reasoning_parser="generic", reasoning_markers=markers).reasoning_markers == markers
    for bad in ({"reasoning_parser": "generic"}, {"reasoning_parser": "generic", "reasoning_markers": ["<r>", ""]},
                {"reasoning_parser": "qwen3", "reasoning_markers": ["<r>", "</r>"]}):
        with pytest.raises(ValueError, match="reasoning_markers"):
            ServerArgs(**bad)
    with pytest.raises(ValueError, match="reasoning_end_id"):
        SamplingParams(reasoning_end_id=3, beam_width=2, temperature=0)


# ---- through `sgl serve` ----

THINK_TEMPLATE = """\
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\
{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def think_model(root: Path) -> Path:
    """SmolLM2's files, its unused special tokens 3 and 4 renamed <think> and </think>
    (plain added tokens, as Qwen3's: skipping special tokens keeps them)."""
    from sgl.sched.models.default_model import default_model_dir

    src, dst = Path(default_model_dir()), root / "think-model"
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    renames = {"<repo_name>": "<think>", "<reponame>": "</think>"}
    tok = json.loads((src / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        if t["content"] in renames:
            t["content"], t["special"] = renames[t["content"]], False
    vocab = tok["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    for t in (cfg.get("added_tokens_decoder") or {}).values():
        if t["content"] in renames:
            t["content"], t["special"] = renames[t["content"]], False
    cfg["additional_special_tokens"] = [t for t in cfg.get("additional_special_tokens", []) if t not in renames]
    cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    (dst / "chat_template.jinja").write_text(THINK_TEMPLATE)
    return dst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return think_model(tmp_path_factory.mktemp("reasoning"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProc]:
    s = ServerProc("--model-path", str(model_dir), "--load-format", "null", "--max-total-tokens", "4000",
                   "--served-model-name", "think", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                   "--custom-logit-processors", "force_tokens")
    yield s
    s.stop()


@pytest.fixture
def oai(server: ServerProc) -> Iterator[openai.OpenAI]:
    c = openai_client(server.url + "/v1", "none", max_retries=0, timeout=120)
    yield c
    c.close()
    server.assert_balanced()


@functools.cache
def tok(model_dir: str) -> Any:
    from sgl.sched.models.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture
def scripted(model_dir: Path) -> Any:
    def make(text: str) -> dict[str, Any]:
        t = tok(str(model_dir))
        ids = list(t.encode(text, add_special_tokens=False)) + [t.eos_token_id]
        return {"custom_logit_processor": "force_tokens", "custom_params": {"tokens": ids}}
    return make


ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "<think>\nThe user asks for 2 + 2. That is 4.\n</think>\n\nIt is 4."


def test_markers_are_tokens(model_dir: Path) -> None:
    t = tok(str(model_dir))
    assert t.encode("<think>", add_special_tokens=False) == [3]
    assert t.encode("</think>", add_special_tokens=False) == [4]
    assert t.decode([3, 4], skip_special_tokens=True) == "<think></think>"


def test_reasoning_content(oai: openai.OpenAI, scripted: Any) -> None:
    r = oai.chat.completions.create(model="think", messages=ASK, max_tokens=64, extra_body=scripted(THOUGHT))
    msg = r.choices[0].message
    assert msg.content == "It is 4." and r.choices[0].finish_reason == "stop"
    extra = msg.model_extra or {}
    assert extra["reasoning_content"] == "The user asks for 2 + 2. That is 4." == extra["reasoning"]
    reasoning_ids = tok_ids(scripted, "\nThe user asks for 2 + 2. That is 4.\n")
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == len(reasoning_ids)


def tok_ids(scripted: Any, text: str) -> list[int]:
    return scripted(text)["custom_params"]["tokens"][:-1]


def streamed(oai: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, str]], Any, Any]:
    """The stream's (kind, text) deltas in order, its tool-call deltas, and its usage."""
    out, calls, usage = [], [], None
    for c in oai.chat.completions.create(model="think", messages=ASK, max_tokens=64, stream=True,
                                         stream_options={"include_usage": True}, **kw):
        usage = c.usage or usage
        for ch in c.choices:
            extra = ch.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                out.append(("reasoning", extra["reasoning_content"]))
            if ch.delta.content:
                out.append(("content", ch.delta.content))
            calls += ch.delta.tool_calls or []
    return out, calls, usage


def test_streamed_reasoning_comes_first(oai: openai.OpenAI, scripted: Any) -> None:
    deltas, _, usage = streamed(oai, extra_body=scripted(THOUGHT))
    kinds = [k for k, _ in deltas]
    # How many deltas depends on the reader's pace (chunks it fell behind on come joined); the
    # splitter's piece-by-piece output is checked on its own in the tests of its feed.
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning") and kinds.count("reasoning") >= 1
    assert "".join(t for k, t in deltas if k == "reasoning") == "The user asks for 2 + 2. That is 4."
    assert "".join(t for k, t in deltas if k == "content") == "It is 4."
    assert usage.completion_tokens_details.reasoning_tokens == len(tok_ids(scripted, "\nThe user asks for 2 + 2. "
                                                                                     "That is 4.\n"))
    whole, _, _ = streamed(oai, extra_body={**scripted(THOUGHT), "stream_reasoning": False})
    assert whole[0] == ("reasoning", "The user asks for 2 + 2. That is 4.")
    assert [k for k, _ in whole[1:]] == ["content"] * (len(whole) - 1)


def test_separate_reasoning_false_keeps_it_in_content(oai: openai.OpenAI, scripted: Any) -> None:
    body = {**scripted(THOUGHT), "separate_reasoning": False}
    r = oai.chat.completions.create(model="think", messages=ASK, max_tokens=64, extra_body=body)
    assert r.choices[0].message.content == THOUGHT
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    deltas, _, _ = streamed(oai, extra_body=body)
    assert "".join(t for _, t in deltas) == THOUGHT and {k for k, _ in deltas} == {"content"}


def test_thinking_off(server: ServerProc, model_dir: Path, oai: openai.OpenAI, scripted: Any) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = server.post("/tokenize", json={"messages": ASK, **off})
    assert tok(str(model_dir)).decode(r.json()["tokens"]).endswith("<think>\n\n</think>\n\n")
    r = oai.chat.completions.create(model="think", messages=ASK, max_tokens=64,
                                    extra_body={**scripted("It is 4."), **off})
    assert r.choices[0].message.content == "It is 4."
    assert (r.choices[0].message.model_extra or {}).get("reasoning_content") is None
    assert r.usage is not None and r.usage.completion_tokens_details.reasoning_tokens == 0
    # Thinking on, and the answer never started: all of it is reasoning.
    r = oai.chat.completions.create(model="think", messages=ASK, max_tokens=5, extra_body=scripted(THOUGHT))
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == ""
    assert (r.choices[0].message.model_extra or {})["reasoning_content"]


TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tools_after_reasoning(oai: openai.OpenAI, scripted: Any) -> None:
    """A call written inside the reasoning is thought, not made; the one after it is made."""
    text = ('<think>Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>? No, '
            'Paris.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    r = oai.chat.completions.create(model="think", messages=ASK, tools=TOOLS, max_tokens=200,
                                    extra_body=scripted(text))
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls or []] == [
        ("get_weather", {"city": "Paris"})]
    assert "Rome" in (ch.message.model_extra or {})["reasoning_content"]
    deltas, calls, _ = streamed(oai, tools=TOOLS, max_completion_tokens=200, extra_body=scripted(text))
    assert {k for k, _ in deltas} == {"reasoning"}
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_grammar_applies_after_the_reasoning(oai: openai.OpenAI, scripted: Any) -> None:
    """The reasoning (free text, not JSON) is let through; the answer must match the schema."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    r = oai.chat.completions.create(model="think", messages=ASK, max_tokens=64, response_format=fmt,  # type: ignore[arg-type]
                                    extra_body=scripted('<think>Two and two: 4.</think>{"answer": 4}'))
    ch = r.choices[0]
    assert json.loads(ch.message.content or "") == {"answer": 4} and ch.finish_reason == "stop"
    assert (ch.message.model_extra or {})["reasoning_content"] == "Two and two: 4."
    # Thinking off: the grammar holds from the first token (no reasoning to let through).
    r = oai.chat.completions.create(model="think", messages=ASK, max_tokens=16, response_format=fmt,  # type: ignore[arg-type]
                                    extra_body={**scripted("<think>x</think>"),
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert not (r.choices[0].message.content or "").startswith("<think>")
