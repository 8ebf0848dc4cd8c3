"""The detokenizer role: turns the scheduler's token ids into text deltas.

Incremental: each request keeps two offsets into its ids; text is only released
once it no longer ends in an incomplete multi-byte character (U+FFFD), and the
last chunk makes the concatenated stream equal the full decode exactly. A
stream holds back a tail that may begin a stop string until it is resolved; the
final text is trimmed at the matched stop (string or id) unless no_stop_trim.
Requests with detokenize=False cost no decode work. It never sees prompts and
never decides when a request ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl.core.log import get_logger
from sgl.core.protocol import (
    CONTROL_REPLIES,
    AttachReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetachReq,
    FinishReason,
    ShutdownReq,
)
from sgl.transports.channel import Receiver, Sender


@dataclass(slots=True)
class _DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    decoded: str = ""  # text decoded so far
    sent: str = ""  # the part of it released (decoded minus a held-back stop-string prefix)


class Detokenizer:
    def __init__(self, tokenizer: Any | None, recv: Receiver, send: Sender) -> None:
        self.tokenizer = tokenizer
        self.recv = recv
        self.send = send
        self.states: dict[str, _DecodeState] = {}
        self.log = get_logger("detokenizer")

    def run(self) -> None:
        while True:
            msg = self.recv.recv()
            if isinstance(msg, ShutdownReq):
                return
            if isinstance(msg, BatchTokenIDOutput):
                self.send.send(self.process(msg))
            elif isinstance(msg, (*CONTROL_REPLIES, AttachReq, DetachReq)):
                self.send.send(msg)  # the sender (an OutputRouter) routes these
            else:
                self.log.warning("ignored unexpected message", type=type(msg).__name__)

    def process(self, b: BatchTokenIDOutput) -> BatchStrOutput:
        texts = [
            self._step(b.rids[i], b.new_ids[i], b.finished_reasons[i], _Opts(
                b.skip_special_tokens[i], b.spaces_between_special_tokens[i], b.no_stop_trim[i], b.stop_strs[i]))
            if b.detokenize[i] and self.tokenizer is not None else ""
            for i in range(len(b.rids))
        ]
        return BatchStrOutput(b.rids, texts, b.new_ids, b.finished_reasons, b.prompt_tokens,
                              b.completion_tokens, b.cached_tokens, b.logprobs)

    def _step(self, rid: str, new_ids: list[int], fin: FinishReason | None, o: _Opts) -> str:
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = _DecodeState()
        st.ids.extend(new_ids)
        if fin is None:
            self._delta(st, o, final=False)
            hold = _held(st.decoded, o.stops) if o.stops else 0
            out = st.decoded[len(st.sent) : len(st.decoded) - hold]
            st.sent += out
            return out
        del self.states[rid]
        matched = fin.get("matched") if fin.get("type") == "stop" and not o.no_stop_trim else None
        ids = st.ids[:-1] if isinstance(matched, int) and st.ids and st.ids[-1] == matched else st.ids
        full = self._decode(ids, o)
        if isinstance(matched, str) and (cut := full.find(matched)) >= 0:
            full = full[:cut]
        if full.startswith(st.sent):
            return full[len(st.sent) :]
        # The tokenizer decodes the whole differently from its parts; keep the stream consistent.
        self._delta(st, o, final=True)
        return st.decoded[len(st.sent) :]

    def _delta(self, st: _DecodeState, o: _Opts, final: bool) -> None:
        surrounding = self._decode(st.ids[st.prefix_offset : st.read_offset], o)
        text = self._decode(st.ids[st.prefix_offset :], o)
        if len(text) <= len(surrounding) or (text.endswith("\ufffd") and not final):
            return
        st.decoded += text[len(surrounding) :]
        st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    def _decode(self, ids: list[int], o: _Opts) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=o.skip, spaces_between_special_tokens=o.spaces)


@dataclass(frozen=True, slots=True)
class _Opts:
    skip: bool
    spaces: bool
    no_stop_trim: bool
    stops: list[str]


def _held(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
