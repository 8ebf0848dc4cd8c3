"""OpenAI tool calling through a real `sgl serve`, with the official openai client.

Two servers on the default model (SmolLM2), both with `--tool-call-parser hermes`,
a `--chat-template` that renders tools Hermes-style (SmolLM2's own does not), and
the built-in `force_tokens` processor allowed: one with real weights in float32,
where the model fills in a forced choice itself (sensible JSON), and one with null
weights, where force_tokens scripts the model's text (auto's tool calls, a parallel
"required" answer, which the grammar must still accept). Covered: a named function, "required" (one call, and
parallel), "auto" parsed from the scripted `<tool_call>` blocks, streamed deltas
reassembled, "none", the template receiving tools and earlier calls, and the 400s.
KV balanced after every test."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.serve_util import ServerProc, openai_client

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 16}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                      "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]

# Hermes-style: the tools in the system turn, calls as <tool_call> JSON blocks.
TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Tools: {% for t in tools %}{{ t.function | tojson }}{% endfor %}
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def start(tmp: pytest.TempPathFactory, *flags: str) -> ServerProc:
    from sgl.sched.models.default_model import default_model_dir

    path = Path(tmp.mktemp("tools")) / "hermes.jinja"
    path.write_text(TEMPLATE)
    return ServerProc("--model-path", default_model_dir(), "--max-total-tokens", "4000", "--served-model-name",
                      "smol", "--tool-call-parser", "hermes", "--chat-template", str(path),
                      "--custom-logit-processors", "force_tokens", *flags)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """Real weights, for the forced choices the model fills in itself."""
    s = start(tmp_path_factory, "--dtype", "float32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """Null weights (instant logits), for the tests whose output force_tokens scripts."""
    s = start(tmp_path_factory, "--load-format", "null")
    yield s
    s.stop()


def client(s: ServerProc) -> Iterator[openai.OpenAI]:
    c = openai_client(s.url + "/v1", "none", max_retries=0, timeout=120)
    yield c
    c.close()
    s.assert_balanced()


@pytest.fixture
def real(real_server: ServerProc) -> Iterator[openai.OpenAI]:
    yield from client(real_server)


@pytest.fixture
def oai(server: ServerProc) -> Iterator[openai.OpenAI]:
    yield from client(server)


@functools.cache
def tok() -> Any:
    from sgl.sched.models.default_model import default_model_dir
    from sgl.sched.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir())


def scripted(text: str) -> dict[str, Any]:
    """extra_body making the model write `text`, then its end of sequence."""
    ids = list(tok().encode(text, add_special_tokens=False)) + [tok().eos_token_id]
    return {"custom_logit_processor": "force_tokens", "custom_params": {"tokens": ids}}


def calls_of(choice: Any) -> list[tuple[str, dict[str, Any]]]:
    calls = choice.message.tool_calls or []
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def streamed(oai: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, dict[str, Any]]], str | None]:
    """A stream's content, its tool-call deltas reassembled by index, and its finish_reason."""
    content, calls, reason = "", {}, None
    for chunk in oai.chat.completions.create(model="smol", stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            reason = ch.finish_reason or reason
    return content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], reason


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_function(real: openai.OpenAI) -> None:
    r = real.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                     max_tokens=64, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    [(name, args)] = calls_of(ch)
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER)


def test_named_function_streamed(oai: openai.OpenAI) -> None:
    """The arguments stream and add up to the whole call (scripted, within the schema's grammar)."""
    args = '{"city": "Paris", "unit": "celsius"}'
    kw: dict[str, Any] = {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 64,
                          "extra_body": scripted(args)}
    r = oai.chat.completions.create(model="smol", **kw)
    assert calls_of(r.choices[0]) == [("get_weather", json.loads(args))]
    assert r.choices[0].message.tool_calls[0].function.arguments == args
    pieces = [d.function.arguments for c in oai.chat.completions.create(model="smol", stream=True, **kw)
              for ch in c.choices for d in ch.delta.tool_calls or []]
    assert pieces and "".join(pieces) == args  # how many pieces depends on the reader's pace
    assert streamed(oai, **kw) == ("", [("get_weather", json.loads(args))], "tool_calls")


def test_required_one_call(real: openai.OpenAI) -> None:
    r = real.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=96, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch.message.content
    [(name, args)] = calls_of(ch)
    jsonschema.validate(args, SCHEMAS[name])


def test_required_parallel(oai: openai.OpenAI) -> None:
    """Two calls in one answer: the grammar of "required" (parallel by default) lets the
    scripted array through, and each element becomes a call."""
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "parameters": {"timezone": "CET"}}]')
    kw: dict[str, Any] = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 96,
                          "extra_body": scripted(text)}
    r = oai.chat.completions.create(model="smol", **kw)
    want = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    assert calls_of(r.choices[0]) == want and r.choices[0].finish_reason == "tool_calls"
    assert streamed(oai, **kw) == ("", want, "tool_calls")


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')


def test_auto_hermes(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"messages": ASK, "tools": TOOLS, "max_tokens": 96, "extra_body": scripted(HERMES)}
    want = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    r = oai.chat.completions.create(model="smol", tool_choice="auto", **kw)
    ch = r.choices[0]
    assert (ch.message.content or "").strip() == "Let me check." and ch.finish_reason == "tool_calls"
    assert calls_of(ch) == want
    content, calls, reason = streamed(oai, **kw)  # auto is the default with tools
    assert (content.strip(), calls, reason) == ("Let me check.", want, "tool_calls")
    one = oai.chat.completions.create(model="smol", parallel_tool_calls=False, **kw)
    assert calls_of(one.choices[0]) == want[:1]
    # A block that is not a call stays content.
    bad = "<tool_call>{not json}</tool_call>"
    r = oai.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, max_tokens=32,
                                    extra_body=scripted(bad))
    assert r.choices[0].message.content == bad and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls


def test_none_gives_content(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 96,
                          "extra_body": scripted(HERMES)}
    r = oai.chat.completions.create(model="smol", **kw)
    assert r.choices[0].message.content == HERMES and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert streamed(oai, **kw) == (HERMES, [], "stop")


def test_template_gets_tools_and_history(server: ServerProc, oai: openai.OpenAI) -> None:
    r = server.post("/tokenize", json={"messages": ASK, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = tok().decode(r.json()["tokens"])
    assert '"name": "get_weather"' in text and "You may call functions" in text
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = server.post("/tokenize", json={"messages": history, "tools": TOOLS})
    assert '{"name": "get_weather", "arguments": {"city": "Paris"' in tok().decode(r.json()["tokens"])
    done = oai.chat.completions.create(model="smol", messages=history, tools=TOOLS, max_tokens=4,
                                       extra_body=scripted("Sunny."))
    assert done.choices[0].message.content == "Sunny."


def test_bad_tool_requests(oai: openai.OpenAI) -> None:
    def refused(param: str, text: str, **kw: Any) -> None:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="smol", messages=ASK, max_tokens=4, **kw)
        body = e.value.body
        assert isinstance(body, dict) and body.get("param") == param and text in body["message"], body

    refused("tool_choice", "'nope'", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    refused("tools", "tools[0]", tools=[{"type": "function", "function": {"description": "no name"}}])
    refused("tools", "tools must be a list", extra_body={"tools": {"name": "f"}})
    refused("tool_choice", "needs tools", tool_choice="required")
    refused("tool_choice", "response_format", tools=TOOLS, tool_choice="required",
            response_format={"type": "json_object"})
    refused("functions", "use tools", extra_body={"functions": [{"name": "f"}]})
