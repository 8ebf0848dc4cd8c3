"""Parsers of the tool calls a model writes in its own format, for tool_choice
"auto" (the server's `--tool-call-parser`).

A parser reads the output as it streams: `feed(text)` takes the next piece and
returns what may be shown now, the content not part of a call and the calls whose
text is complete; `finish()` returns what was held back at the end. Nothing that
could still turn out to be a call is shown as content early, and nothing the
parser cannot read as a call is lost: an unreadable block (bad JSON, no name, a
function that was not offered) goes back as content, as written.

- hermes (aliases qwen, qwen25: Hermes 2 Pro, Qwen 2.5 / 3): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text before
  them stays content (whitespace right after a block is dropped); a last block left
  unclosed at the end is read all the same.
- llama3 (alias llama3_json: Llama 3.1 / 3.2 JSON tool calling): the whole message
  is `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally after
  `<|python_tag|>`, or several such objects separated by `;`. A message that starts
  otherwise is content, streamed as it comes; one that starts with `{` is held to
  the end.
- mistral (Mistral 7B v0.3 to Small 3.2, Devstral): content, then `[TOOL_CALLS]` and
  either a JSON list of `{"name": ..., "arguments": {...}}` objects (its older
  tokenizers) or `name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]` (v11
  and later). Content before the first `[TOOL_CALLS]` streams; the rest is held to the
  end. `[TOOL_CALLS]` is a special token: the route keeps special tokens in the text.
- pythonic (Llama 3.2, Llama 4, and others prompted so): the whole message is a Python
  list of calls with keyword arguments, `[f(a=1), g(b="x")]`, optionally between
  `<|python_start|>` and `<|python_end|>`; argument values are Python literals (and
  JSON's true, false, null). Read with `ast`, never evaluated. A message that starts
  otherwise is content; one that starts with `[` is held to the end."""

from __future__ import annotations

import ast
import json
from collections.abc import Collection
from typing import Any, NamedTuple


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # the arguments as JSON text


class Parsed(NamedTuple):
    content: str
    calls: list[ParsedCall]


def call_of(obj: Any, names: Collection[str] | None, keys: tuple[str, ...]) -> ParsedCall | None:
    """`{"name": str, <key>: object or JSON text}` as a call, or None when it is not one
    (or names a function outside `names`, when given)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Base: everything is content. `names`: the functions offered (others are content)."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names

    def feed(self, text: str) -> Parsed:
        return Parsed(text, [])

    def finish(self) -> Parsed:
        return Parsed("", [])


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (it may become the tag)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, names: Collection[str] | None = None) -> None:
        super().__init__(names)
        self._buf = ""
        self._in_call = False
        self._after_call = False  # drop the whitespace that follows a block

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def _block(self, body: str, closed: bool) -> Parsed:
        try:
            call = call_of(json.loads(body), self.names, ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            return Parsed(self._content(self.START + body + (self.END if closed else "")), [])
        self._after_call = True
        return Parsed("", [call])

    def feed(self, text: str) -> Parsed:
        self._buf += text
        content, calls = [], []
        while True:
            if not self._in_call:
                i = self._buf.find(self.START)
                if i < 0:
                    keep = _held_prefix(self._buf, self.START)
                    content.append(self._content(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._content(self._buf[:i]))
                self._buf, self._in_call = self._buf[i + len(self.START):], True
            j = self._buf.find(self.END)
            if j < 0:
                break
            got = self._block(self._buf[:j], closed=True)
            content.append(got.content)
            calls += got.calls
            self._buf, self._in_call = self._buf[j + len(self.END):], False
        return Parsed("".join(content), calls)

    def finish(self) -> Parsed:
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return self._block(buf, closed=False)
        return Parsed(self._content(buf), [])


class Llama3Parser(ToolParser):
    TAG = "<|python_tag|>"

    def __init__(self, names: Collection[str] | None = None) -> None:
        super().__init__(names)
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "content"; "json": held to the end

    def feed(self, text: str) -> Parsed:
        if self._mode == "content":
            return Parsed(text, [])
        self._buf += text
        if self._mode == "json":
            return Parsed("", [])
        head = self._buf.lstrip()
        if self.TAG.startswith(head):
            return Parsed("", [])  # nothing yet, or a start of the tag
        if head.startswith(self.TAG):
            head = head[len(self.TAG):].lstrip()
            if not head:
                return Parsed("", [])
        if head.startswith("{"):
            self._mode = "json"
            return Parsed("", [])
        self._mode, buf, self._buf = "content", self._buf, ""
        return Parsed(buf, [])

    def finish(self) -> Parsed:
        buf, self._buf = self._buf, ""
        if self._mode != "json":
            return Parsed(buf, [])
        calls = self._calls(buf.strip().removeprefix(self.TAG))
        return Parsed("", calls) if calls else Parsed(buf, [])

    def _calls(self, text: str) -> list[ParsedCall] | None:
        """The `;`-separated objects of `text` as calls, or None unless every one is a call."""
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            call = call_of(obj, self.names, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = text[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            pos = len(text) - len(rest) + 1


def json_calls(text: str, names: Collection[str] | None, keys: tuple[str, ...]) -> list[ParsedCall] | None:
    """The calls of `text`: JSON call objects, or lists of them, one after another (commas
    between them allowed); None unless all of it is calls."""
    decoder, pos, calls = json.JSONDecoder(), 0, list[ParsedCall]()
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = call_of(item, names, keys)
            if call is None:
                return None
            calls.append(call)


class MistralParser(ToolParser):
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, names: Collection[str] | None = None) -> None:
        super().__init__(names)
        self._buf = ""
        self._in_calls = False  # past the first [TOOL_CALLS]: held to the end

    def feed(self, text: str) -> Parsed:
        self._buf += text
        if self._in_calls:
            return Parsed("", [])
        i = self._buf.find(self.TAG)
        if i < 0:
            keep = _held_prefix(self._buf, self.TAG)
            shown, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            return Parsed(shown, [])
        shown, self._buf, self._in_calls = self._buf[:i], self._buf[i + len(self.TAG):], True
        return Parsed(shown, [])

    def finish(self) -> Parsed:
        buf, self._buf = self._buf, ""
        if not self._in_calls:
            return Parsed(buf, [])
        calls = self._calls(buf)
        return Parsed("", calls) if calls else Parsed(self.TAG + buf, [])

    def _calls(self, body: str) -> list[ParsedCall] | None:
        calls: list[ParsedCall] = []
        for part in body.split(self.TAG):
            if self.ARGS in part:  # name[ARGS]{...}
                name, _, args = part.partition(self.ARGS)
                try:
                    call = call_of({"name": name.strip(), "arguments": json.loads(args)}, self.names, ("arguments",))
                except ValueError:
                    return None
                if call is None:
                    return None
                calls.append(call)
            elif part.strip():
                got = json_calls(part, self.names, ("arguments", "parameters"))
                if got is None:
                    return None
                calls += got
        return calls or None


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> object:
    """A Python literal's value (JSON's true, false and null too); ValueError otherwise."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


class PythonicParser(ToolParser):
    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self, names: Collection[str] | None = None) -> None:
        super().__init__(names)
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "content"; "calls": held to the end

    def feed(self, text: str) -> Parsed:
        if self._mode == "content":
            return Parsed(text, [])
        self._buf += text
        if self._mode == "calls":
            return Parsed("", [])
        head = self._buf.lstrip()
        if self.START.startswith(head):
            return Parsed("", [])  # nothing yet, or a start of the tag
        if head.startswith(self.START):
            head = head[len(self.START):].lstrip()
            if not head:
                return Parsed("", [])
        if head.startswith("["):
            self._mode = "calls"
            return Parsed("", [])
        self._mode, buf, self._buf = "content", self._buf, ""
        return Parsed(buf, [])

    def finish(self) -> Parsed:
        buf, self._buf = self._buf, ""
        if self._mode != "calls":
            return Parsed(buf, [])
        calls = self._calls(buf.strip().removeprefix(self.START).removesuffix(self.END))
        return Parsed("", calls) if calls else Parsed(buf, [])

    def _calls(self, text: str) -> list[ParsedCall] | None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
                    or any(k.arg is None for k in node.keywords)):
                return None
            try:
                args = {k.arg: _literal(k.value) for k in node.keywords}
            except (ValueError, TypeError, SyntaxError):
                return None
            call = call_of({"name": node.func.id, "arguments": args}, self.names, ("arguments",))
            if call is None:
                return None
            calls.append(call)
        return calls


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "qwen": HermesParser, "qwen25": HermesParser,
                                        "llama3": Llama3Parser, "llama3_json": Llama3Parser,
                                        "mistral": MistralParser, "pythonic": PythonicParser}


def parse_all(parser: ToolParser, text: str) -> Parsed:
    """A whole output, parsed at once."""
    a, b = parser.feed(text), parser.finish()
    return Parsed(a.content + b.content, a.calls + b.calls)
