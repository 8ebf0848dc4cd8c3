"""A reasoning model's thinking, told apart from its answer (the server's
`--reasoning-parser`), for /v1/chat/completions' `reasoning_content`.

A `ReasoningFormat` names the two markers and whether a request's output starts
inside the reasoning: DeepSeek-R1 always does (its template opens the thinking in
the prompt); Qwen3 and the generic format do unless the request's
chat_template_kwargs set `enable_thinking` to anything but true (SGLang's rule),
since a template may open the thinking in the prompt too. An output may still open
with the start marker (after whitespace): it is dropped and what follows is
reasoning, whatever the request said.

A `ReasoningSplitter` reads one choice's output as it streams: `feed(text)` returns
the reasoning and the content that may be shown now, `finish()` what was held. Held
back: a partial marker, and whitespace that would end the reasoning. The reasoning
is the text between the markers without the whitespace around it; the content is
what follows the end marker, its leading whitespace dropped. No end marker: all of
it is reasoning (the answer never started). Any split of an output into pieces gives
what the whole output gives.

It decides nothing about generation: the grammar of a request that reasons starts
after the end marker's token in the scheduler (SamplingParams.reasoning_end_id)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    always: bool = False  # the output always starts inside the reasoning

    def starts_inside(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a request's output starts inside the reasoning."""
        return self.always or (chat_template_kwargs or {}).get("enable_thinking", True) is True


FORMATS = {"qwen3": ReasoningFormat("<think>", "</think>"),
           "deepseek-r1": ReasoningFormat("<think>", "</think>", always=True)}


def format_of(parser: str | None, markers: Sequence[str] = ()) -> ReasoningFormat | None:
    """The server's format (`reasoning_parser`, `reasoning_markers`), or None without a parser."""
    if parser is None:
        return None
    if parser == "generic":
        start, end = markers
        return ReasoningFormat(start, end)
    return FORMATS[parser]


class Split(NamedTuple):
    reasoning: str
    content: str


def _partial_end(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """One choice's output as (reasoning, content) pieces. `stream=False` holds the
    reasoning back and gives it whole once it ends (SGLang's stream_reasoning=false)."""

    def __init__(self, fmt: ReasoningFormat, inside: bool, stream: bool = True) -> None:
        self.fmt = fmt
        self.inside = inside  # before the start marker is known: where the output starts
        self.stream = stream
        self._phase = "head"  # head: the start marker may still come; reasoning; content
        self._buf = ""  # held text: a partial marker, or whitespace
        self._reasoning_began = False  # its first non-space character was given
        self._content_began = False  # its first non-space character after the end marker was given
        self._after_end = False
        self._kept: list[str] = []  # stream=False: the reasoning so far

    @property
    def in_reasoning(self) -> bool:
        return self._phase == "reasoning" or (self._phase == "head" and self.inside)

    def feed(self, text: str) -> Split:
        self._buf += text
        reasoning, content = [], []
        if self._phase == "head":
            head = self._buf.lstrip()
            if len(head) < len(self.fmt.start) and self.fmt.start.startswith(head):
                return self._out("", "")  # whitespace, or a start of the marker: wait
            if head.startswith(self.fmt.start):
                self._buf = head[len(self.fmt.start):]
                self._phase = "reasoning"
            else:
                self._phase = "reasoning" if self.inside else "content"
        if self._phase == "reasoning":
            i = self._buf.find(self.fmt.end)
            if i < 0:
                keep = _partial_end(self._buf, self.fmt.end)
                body = self._buf[:len(self._buf) - keep]
                shown = body.rstrip()  # trailing whitespace waits: it may end the reasoning
                reasoning.append(self._reasoning(shown))
                self._buf = body[len(shown):] + self._buf[len(body):]
                return self._out("".join(reasoning), "")
            reasoning.append(self._reasoning(self._buf[:i].rstrip()))
            self._buf = self._buf[i + len(self.fmt.end):]
            self._phase, self._after_end = "content", True
        content.append(self._content(self._buf))
        self._buf = ""
        return self._out("".join(reasoning), "".join(content), ended=self._after_end)

    def finish(self) -> Split:
        buf, self._buf = self._buf, ""
        if self._phase == "head":
            if not self.inside:
                return self._out("", buf, ended=True)
            buf = buf.lstrip()
        if self.in_reasoning:
            self._phase = "content"
            return self._out(self._reasoning(buf.rstrip()), "", ended=True)
        return self._out("", self._content(buf), ended=True)

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_began:
            text = text.lstrip()
            self._reasoning_began = bool(text)
        return text

    def _content(self, text: str) -> str:
        if self._after_end and not self._content_began:
            text = text.lstrip()
            self._content_began = bool(text)
        return text

    def _out(self, reasoning: str, content: str, ended: bool = False) -> Split:
        if self.stream:
            return Split(reasoning, content)
        self._kept.append(reasoning)
        if not ended:
            return Split("", content)
        whole, self._kept = "".join(self._kept), []
        return Split(whole, content)

    def split(self, text: str) -> Split:
        """A whole output at once (a fresh splitter's only call)."""
        a, b = self.feed(text), self.finish()
        return Split(a.reasoning + b.reasoning, a.content + b.content)


def reasoning_tokens(ids: Sequence[int], start: Sequence[int], end: Sequence[int], inside: bool) -> int:
    """How many of an output's token ids are its reasoning (between the markers, whose ids
    are `start` and `end`; to the output's end when the end marker never came), as
    vLLM counts them. Exact when each marker is one token (Qwen3's, DeepSeek-R1's)."""
    ids = list(ids)
    i = 0
    if start and ids[:len(start)] == list(start):
        i, inside = len(start), True
    if not inside:
        return 0
    n = len(end)
    for j in range(i, len(ids) - n + 1):
        if n and ids[j:j + n] == list(end):
            return j - i
    return len(ids) - i


@dataclass(frozen=True)
class ReasoningPlan:
    """What one chat request does with its choices' reasoning: `separate` (SGLang's
    separate_reasoning, default true) splits it out, `stream` (stream_reasoning, default
    true) streams it as it comes. The marker ids count the reasoning tokens and name the
    token after which a grammar starts."""

    fmt: ReasoningFormat
    inside: bool  # the output starts inside the reasoning
    separate: bool
    stream: bool
    start_ids: list[int]
    end_ids: list[int]

    def splitter(self) -> ReasoningSplitter | None:
        return ReasoningSplitter(self.fmt, self.inside, self.stream) if self.separate else None

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output's (reasoning, content); reasoning None when not split out or empty."""
        s = self.splitter()
        if s is None:
            return None, text
        got = s.split(text)
        return got.reasoning or None, got.content

    def tokens(self, ids: Sequence[int]) -> int:
        return reasoning_tokens(ids, self.start_ids, self.end_ids, self.inside)

    @property
    def end_id(self) -> int | None:
        """The end marker's token id, when it is one token."""
        return self.end_ids[0] if len(self.end_ids) == 1 else None
