"""Tool calling without a server: the hermes, llama3, mistral and pythonic parsers
(whole and fed piece by piece, partial and invalid blocks; mistral's and pythonic's
on the texts the models' chat templates and model cards show), the tool plan's checks and the schemas of
forced choices, each choice's deltas and message (server/tool_calls), and the
template receiving tools and earlier calls (server/chat_render)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sgl.server.common import ApiError
from sgl.server.tool_calls import ChoiceTools, merged, message, plan, tool_schema
from sgl.server.tool_parsers import (
    HermesParser,
    Llama3Parser,
    MistralParser,
    Parsed,
    ParsedCall,
    PythonicParser,
    ToolParser,
    parse_all,
)

NAMES = ["get_weather", "get_time"]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "the time now"}}]


def fed(parser: ToolParser, text: str, step: int) -> Parsed:
    """`text` fed `step` characters at a time, then finished."""
    content, calls = "", []
    for k in range(0, len(text), step):
        got = parser.feed(text[k:k + step])
        content, calls = content + got.content, calls + got.calls
    got = parser.finish()
    return Parsed(content + got.content, calls + got.calls)


HERMES_CASES: dict[str, tuple[str, Parsed]] = {
    "plain": ("Hello <b>there</b> <tool_ca", Parsed("Hello <b>there</b> <tool_ca", [])),
    "one": (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
            Parsed("Let me check.\n", [ParsedCall("get_weather", '{"city": "Paris"}')])),
    "two": (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{{\"name\": \"get_time\", \"arguments\": {{}}}}"
            "</tool_call>\n", Parsed("", [ParsedCall("get_weather", '{"city": "Paris"}'),
                                          ParsedCall("get_time", "{}")])),
    "unclosed": (f"<tool_call>{WEATHER}", Parsed("", [ParsedCall("get_weather", '{"city": "Paris"}')])),
    "partial": ('<tool_call>{"name": "get_wea', Parsed('<tool_call>{"name": "get_wea', [])),
    "bad-json": ("a <tool_call>{oops}</tool_call> b", Parsed("a <tool_call>{oops}</tool_call> b", [])),
    "unknown-function": ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
                         Parsed('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', [])),
    "no-name": ('<tool_call>{"arguments": {}}</tool_call>', Parsed('<tool_call>{"arguments": {}}</tool_call>', [])),
    "string-arguments": ('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>',
                         Parsed("", [ParsedCall("get_time", '{"tz": "CET"}')])),
    "text-after": (f"<tool_call>{WEATHER}</tool_call>\n\nDone.", Parsed("Done.", [ParsedCall("get_weather",
                                                                                          '{"city": "Paris"}')])),
}


@pytest.mark.parametrize("case", list(HERMES_CASES))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes(case: str, step: int) -> None:
    text, want = HERMES_CASES[case]
    assert fed(HermesParser(NAMES), text, step) == want


def test_hermes_holds_only_what_may_become_a_tag() -> None:
    p = HermesParser(NAMES)
    assert p.feed("Sure <tool") == Parsed("Sure ", [])
    assert p.feed("s>") == Parsed("<tools>", [])
    assert p.feed("<tool_call>" + WEATHER[:10]) == Parsed("", [])
    assert p.feed(WEATHER[10:] + "</tool_call>") == Parsed("", [ParsedCall("get_weather", '{"city": "Paris"}')])


LLAMA_CASES: dict[str, tuple[str, Parsed]] = {
    "one": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
            Parsed("", [ParsedCall("get_weather", '{"city": "Paris"}')])),
    "python-tag": ('<|python_tag|>{"name": "get_time", "arguments": {}}', Parsed("", [ParsedCall("get_time", "{}")])),
    "several": ('{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}',
                Parsed("", [ParsedCall("get_weather", '{"city": "a;b"}'), ParsedCall("get_time", "{}")])),
    "content": ("The weather is fine.", Parsed("The weather is fine.", [])),
    "truncated": ('{"name": "get_weather", "parameters": {"ci', Parsed('{"name": "get_weather", "parameters": {"ci',
                                                                       [])),
    "not-a-call": ('{"answer": 42}', Parsed('{"answer": 42}', [])),
    "trailing-text": ('{"name": "get_time", "parameters": {}} thanks', Parsed(
        '{"name": "get_time", "parameters": {}} thanks', [])),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_llama3(case: str, step: int) -> None:
    text, want = LLAMA_CASES[case]
    assert fed(Llama3Parser(NAMES), text, step) == want


def test_llama3_streams_content_once_it_is_not_json() -> None:
    p = Llama3Parser()
    assert p.feed("  ") == Parsed("", [])
    assert p.feed("Hi") == Parsed("  Hi", [])
    assert p.feed(" there") == Parsed(" there", [])
    assert parse_all(Llama3Parser(), '{"name": "x", "parameters": {}}') == Parsed("", [ParsedCall("x", "{}")])


PARIS = ParsedCall("get_weather", '{"city": "Paris"}')
CET = ParsedCall("get_time", '{"timezone": "CET"}')
# Mistral 7B Instruct v0.3's template writes an assistant's calls as `[TOOL_CALLS] [` then each
# call's `function | tojson` with its 9-character id, then `]`; v11+ tokenizers (Mistral
# Small 3.2, Devstral) write `[TOOL_CALLS]name[ARGS]{...}` per call.
MISTRAL_CASES: dict[str, tuple[str, Parsed]] = {
    "v3": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]',
           Parsed("", [PARIS])),
    "v3-two": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "arguments": {"timezone": "CET"}}]', Parsed("", [PARIS, CET])),
    "v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', Parsed("", [PARIS])),
    "v11-two": ('Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
                '{"timezone": "CET"}', Parsed("Let me look.", [PARIS, CET])),
    "content-first": ('Let me search for that.\n[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
                      '"Paris"}}]', Parsed("Let me search for that.\n", [PARIS])),
    "plain": ("No tools [TOOL", Parsed("No tools [TOOL", [])),
    "truncated": ('[TOOL_CALLS] [{"name": "get_weather", "argu', Parsed('[TOOL_CALLS] [{"name": "get_weather", "argu',
                                                                     [])),
    "unknown-function": ('[TOOL_CALLS]rm[ARGS]{}', Parsed('[TOOL_CALLS]rm[ARGS]{}', [])),
    "bad-args": ('[TOOL_CALLS]get_time[ARGS]{oops', Parsed('[TOOL_CALLS]get_time[ARGS]{oops', [])),
}


@pytest.mark.parametrize("case", list(MISTRAL_CASES))
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_mistral(case: str, step: int) -> None:
    text, want = MISTRAL_CASES[case]
    assert fed(MistralParser(NAMES), text, step) == want


def test_mistral_streams_content_before_the_calls() -> None:
    p = MistralParser(NAMES)
    assert p.feed("Sure [TOOL") == Parsed("Sure ", [])
    assert p.feed("S] x") == Parsed("[TOOLS] x", [])
    assert p.feed('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') == Parsed("", [])
    assert p.finish() == Parsed("", [PARIS])


# Llama 3.2's system prompt asks for `[func_name1(params_name1=params_value1, ...), func_name2(params)]`;
# Llama 4 may put the list between <|python_start|> and <|python_end|>.
PYTHONIC_CASES: dict[str, tuple[str, Parsed]] = {
    "one": ('[get_weather(city="Paris")]', Parsed("", [PARIS])),
    "two": ("[get_weather(city='Paris'), get_time(timezone=\"CET\")]", Parsed("", [PARIS, CET])),
    "llama4-tags": ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', Parsed("", [PARIS])),
    "literals": ('[get_time(timezone="CET", n=-2, f=1.5, ok=True, no=false, x=None, l=[1, "a"], d={"k": null})]',
                 Parsed("", [ParsedCall("get_time", json.dumps({"timezone": "CET", "n": -2, "f": 1.5, "ok": True,
                                                                 "no": False, "x": None, "l": [1, "a"],
                                                                 "d": {"k": None}}))])),
    "no-args": ("[get_time()]", Parsed("", [ParsedCall("get_time", "{}")])),
    "content": ("It is sunny in Paris.", Parsed("It is sunny in Paris.", [])),
    "positional": ('[get_weather("Paris")]', Parsed('[get_weather("Paris")]', [])),
    "code-not-literal": ("[get_time(timezone=__import__('os').getcwd())]",
                         Parsed("[get_time(timezone=__import__('os').getcwd())]", [])),
    "unknown-function": ("[rm(path='/')]", Parsed("[rm(path='/')]", [])),
    "truncated": ('[get_weather(city="Par', Parsed('[get_weather(city="Par', [])),
    "markdown": ("[a link](http://x)", Parsed("[a link](http://x)", [])),
}


@pytest.mark.parametrize("case", list(PYTHONIC_CASES))
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_pythonic(case: str, step: int) -> None:
    text, want = PYTHONIC_CASES[case]
    assert fed(PythonicParser(NAMES), text, step) == want


def test_pythonic_in_a_choice() -> None:
    p = plan(TOOLS, "auto", None, "pythonic")
    msg, reason = message(p, '[get_weather(city="Paris"), get_time()]', "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def bad(tools: Any, choice: Any = None, parallel: Any = None) -> ApiError:
    with pytest.raises(ApiError) as e:
        plan(tools, choice, parallel, "hermes")
    return e.value


def test_plan_checks() -> None:
    assert plan(None, None, None, "hermes").mode == "none"
    assert plan(TOOLS, None, None, "hermes") == plan(TOOLS, "auto", True, "hermes")
    assert plan(TOOLS, "auto", None, None).parser is None
    assert plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, None).named == "get_time"
    e = bad(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert e.param == "tool_choice" and "'nope'" in e.message and e.status == 400
    assert bad(TOOLS, "sometimes").param == "tool_choice"
    assert bad(None, "required").param == "tool_choice"
    assert bad(TOOLS, {"function": {"name": "get_time"}}).param == "tool_choice"
    for tools in ({"type": "function"}, [{"type": "retrieval"}], [{"type": "function", "function": {}}],
                  [{"type": "function", "function": {"name": "f", "parameters": "x"}}], TOOLS + TOOLS[:1]):
        assert bad(tools).param == "tools", tools
    assert bad(TOOLS, "auto", "yes").param == "parallel_tool_calls"


def test_forced_schemas() -> None:
    named = json.loads(tool_schema(plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None,
                                        None)) or "")
    assert named == TOOLS[0]["function"]["parameters"]
    req = json.loads(tool_schema(plan(TOOLS, "required", False, None)) or "")
    assert req["type"] == "array" and req["minItems"] == 1 and req["maxItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in req["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert req["items"]["anyOf"][1]["properties"]["parameters"]["additionalProperties"] is False
    assert "maxItems" not in json.loads(tool_schema(plan(TOOLS, "required", None, None)) or "")
    assert tool_schema(plan(TOOLS, "auto", None, "hermes")) is None


def test_named_streams_arguments_as_they_come() -> None:
    ct = ChoiceTools(plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None))
    first = ct.feed('{"city"')
    assert first[0] == "" and first[1][0]["id"].startswith("call_") and first[1][0]["function"] == {
        "name": "get_weather", "arguments": '{"city"'}
    second = ct.feed(': "Paris"}')
    assert second == ("", [{"index": 0, "function": {"arguments": ': "Paris"}'}}])
    assert ct.finish() == ("", [])
    calls = merged(first[1] + second[1])
    assert len(calls) == 1 and calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    assert ct.finish_reason("stop") == "tool_calls" and ct.finish_reason("length") == "length"


def test_messages() -> None:
    req = plan(TOOLS, "required", None, None)
    msg, reason = message(req, '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                               '"parameters": {"city": "Oslo"}}]', "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    cut = '[{"name": "get_time", "param'
    assert message(req, cut, "length") == ({"role": "assistant", "content": cut}, "length")
    one = plan(TOOLS, "auto", False, "hermes")
    two = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    assert len(message(one, two, "stop")[0]["tool_calls"]) == 1
    assert len(message(plan(TOOLS, "auto", None, "hermes"), two, "stop")[0]["tool_calls"]) == 2
    assert message(plan(TOOLS, "none", None, "hermes"), two, "stop") == ({"role": "assistant", "content": two},
                                                                         "stop")


def test_template_gets_tools_and_earlier_calls() -> None:
    import asyncio

    from sgl.runtime.tokenizer_client import LocalTokenizer
    from sgl.server.chat_render import chat_prompt_ids, conversation
    from sgl.server.openai_protocol import ChatMessage

    class Tok:
        chat_template = "x"
        seen: dict[str, Any] = {}

        def apply_chat_template(self, conv: list[dict[str, Any]], **kw: Any) -> str:
            self.seen.update(kw, conv=conv)
            return "rendered"

        def __call__(self, texts: list[str], add_special_tokens: bool) -> dict[str, list[list[int]]]:
            assert texts == ["rendered"] and not add_special_tokens
            return {"input_ids": [[1, 2]]}

    raw = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
           {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    tok = Tok()
    assert asyncio.run(chat_prompt_ids(LocalTokenizer(tok), raw, tools=TOOLS)) == [1, 2]
    assert tok.seen["tools"] == TOOLS
    assert tok.seen["conv"][1]["tool_calls"][0]["function"]["arguments"] == {"tz": "CET"}
    assert conversation(ChatMessage.parse(raw))[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
