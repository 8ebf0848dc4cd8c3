"""OpenAI tool calling on /v1/chat/completions: `tools`, `tool_choice` and
`parallel_tool_calls` checked and turned into a plan, the grammar that enforces a
forced choice, and each choice's output turned into `tool_calls`.

- tool_choice "none": the tools reach the template, the output is plain content.
- "auto" (the default when tools are given): the model writes as it likes; the
  server's `--tool-call-parser` (tool_parsers) reads its calls out of the text.
  Without a parser the output is plain content.
- a named function (`{"type": "function", "function": {"name": ...}}`): the output
  is constrained (through the grammar backend) to that function's parameters
  schema and comes back as one call; its arguments stream as they are made.
- "required": the output is constrained to a JSON array of `{"name", "parameters"}`
  objects, one per call, each naming an offered tool and matching its schema
  (`anyOf`); one call at most unless parallel_tool_calls (default true).

Calls have ids `call_<hex>`; a choice that made any ends with finish_reason
"tool_calls" (unless cut short by max_tokens: "length") and content null when
nothing else was said. parallel_tool_calls=false keeps the first call "auto" finds.
Streams show a call once its text is complete (a named call: its arguments as they
come), as OpenAI's tool-call deltas (index, id, type, function name, arguments)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, NamedTuple

from sgl.server.common import ApiError
from sgl.server.tool_parsers import PARSERS, Parsed, ParsedCall, ToolParser

Mode = Literal["none", "auto", "required", "named"]


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def check_tools(raw: Any) -> list[dict[str, Any]] | None:
    """The tools as the template reads them (OpenAI's shape), or a 400 naming tools."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    out, seen = [], set()
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in seen:
            raise _bad(f"tools[{i}].function.name={name!r} is given twice", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"tools[{i}].function.description must be a string", "tools")
        seen.add(name)
        out.append({"type": "function", "function": fn})
    return out


class ToolPlan(NamedTuple):
    mode: Mode
    tools: list[dict[str, Any]] | None  # what the template gets
    named: str | None = None  # mode "named": the function
    parser: str | None = None  # mode "auto": the parser's name, None for plain content
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools or []]

    def params_of(self, name: str) -> dict[str, Any]:
        fn = next(t["function"] for t in self.tools or [] if t["function"]["name"] == name)
        params = fn.get("parameters")
        # A function without parameters takes none: its arguments are {}.
        return params if params else {"type": "object", "properties": {}, "additionalProperties": False}


def plan(tools_raw: Any, choice: Any, parallel: Any, parser: str | None) -> ToolPlan:
    """The plan for a request's tool fields (a 400 naming the field that is wrong)."""
    tools = check_tools(tools_raw)
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls", "invalid_type")
    par = parallel is not False
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad(f"tool_choice={choice!r} is invalid: must be none, auto, required or "
                       "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if choice == "required" and not tools:
            raise _bad("tool_choice='required' needs tools", "tool_choice")
        mode: Mode = choice  # type: ignore[assignment]
        return ToolPlan(mode, tools, parser=parser if mode == "auto" and tools else None, parallel=par)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise _bad("tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
                   "tool_choice")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise _bad(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return ToolPlan("named", tools, named=name, parallel=par)


def tool_schema(p: ToolPlan) -> str | None:
    """The JSON Schema (text) the output must match, for a forced choice; None otherwise."""
    if p.mode == "named":
        assert p.named is not None
        return json.dumps(p.params_of(p.named))
    if p.mode != "required":
        return None
    one = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p.params_of(n)},
            "required": ["name", "parameters"], "additionalProperties": False} for n in p.names]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
    if not p.parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceTools:
    """One choice's output, piece by piece, as (content, tool-call deltas); `finish`
    gives what was held to the end. A delta is OpenAI's
    `{"index", "id", "type", "function": {"name", "arguments"}}` (a named call's later
    deltas carry only index and arguments)."""

    def __init__(self, p: ToolPlan) -> None:
        self.plan = p
        self.calls = 0  # calls shown so far
        self._held: list[str] = []  # mode required: the whole output
        self._parser: ToolParser | None = None
        if p.mode == "auto" and p.parser is not None:
            self._parser = PARSERS[p.parser](p.names)

    def _deltas(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        if not self.plan.parallel:
            calls = calls[:max(0, 1 - self.calls)]
        out = [{"index": self.calls + k, "id": call_id(), "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(calls)]
        self.calls += len(out)
        return out

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        mode = self.plan.mode
        if mode == "named":
            if self.calls == 0:
                self.calls = 1
                return "", [{"index": 0, "id": call_id(), "type": "function",
                             "function": {"name": self.plan.named, "arguments": text}}]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        if mode == "required":
            self._held.append(text)
            return "", []
        if self._parser is None:
            return text, []
        got = self._parser.feed(text)
        return got.content, self._deltas(got.calls)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.plan.mode == "named":
            return self.feed("") if self.calls == 0 else ("", [])
        if self.plan.mode == "required":
            text = "".join(self._held)
            got = _required_calls(text, self.plan.names)
            return got.content, self._deltas(got.calls)
        if self._parser is None:
            return "", []
        got = self._parser.finish()
        return got.content, self._deltas(got.calls)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason


def _required_calls(text: str, names: list[str]) -> Parsed:
    """The calls of a "required" output (a JSON array), or the text as content if it is not
    one (cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return Parsed(text, [])
    calls = []
    for item in items if isinstance(items, list) else [None]:
        if not isinstance(item, dict) or item.get("name") not in names or not isinstance(item.get("parameters"),
                                                                                           dict):
            return Parsed(text, [])
        calls.append(ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return Parsed("", calls)


def merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's tool_calls from its deltas (a named call's arguments joined)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d["index"] in calls:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        else:
            calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
    return [calls[i] for i in sorted(calls)]


def message(p: ToolPlan, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice's assistant message and finish_reason."""
    ct = ChoiceTools(p)
    c1, d1 = ct.feed(text)
    c2, d2 = ct.finish()
    content, calls = c1 + c2, merged(d1 + d2)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["content"] = content if content.strip() else None
        msg["tool_calls"] = calls
    return msg, ct.finish_reason(reason)
