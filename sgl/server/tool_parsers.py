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
  the end."""

from __future__ import annotations

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


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "qwen": HermesParser, "qwen25": HermesParser,
                                        "llama3": Llama3Parser, "llama3_json": Llama3Parser}


def parse_all(parser: ToolParser, text: str) -> Parsed:
    """A whole output, parsed at once."""
    a, b = parser.feed(text), parser.finish()
    return Parsed(a.content + b.content, a.calls + b.calls)
