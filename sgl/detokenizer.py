"""The detokenizer role: turns the scheduler's token ids into text deltas.

Incremental: each request keeps two offsets into its ids; text is only released
once it no longer ends in an incomplete multi-byte character (U+FFFD), and the
last chunk makes the concatenated stream equal the full decode exactly. It
never sees prompts and never decides when a request ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl.log import get_logger
from sgl.protocol import CONTROL_REPLIES, AttachReq, BatchStrOutput, BatchTokenIDOutput, DetachReq, ShutdownReq
from sgl.transports.channel import Receiver, Sender


@dataclass(slots=True)
class _DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    sent: str = ""


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
        texts = [self._step(rid, ids, fin is not None, skip)
                 for rid, ids, fin, skip in zip(b.rids, b.new_ids, b.finished_reasons, b.skip_special_tokens)]
        return BatchStrOutput(b.rids, texts, b.new_ids, b.finished_reasons, b.prompt_tokens,
                              b.completion_tokens, b.cached_tokens)

    def _step(self, rid: str, new_ids: list[int], finished: bool, skip: bool) -> str:
        if self.tokenizer is None:
            return ""
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = _DecodeState()
        st.ids.extend(new_ids)
        if finished:
            del self.states[rid]
            full = self._decode(st.ids, skip)
            if full.startswith(st.sent):
                return full[len(st.sent) :]
            # The tokenizer decodes the whole differently from its parts; keep the stream consistent.
            return self._delta(st, skip, final=True)
        return self._delta(st, skip, final=False)

    def _delta(self, st: _DecodeState, skip: bool, final: bool) -> str:
        surrounding = self._decode(st.ids[st.prefix_offset : st.read_offset], skip)
        text = self._decode(st.ids[st.prefix_offset :], skip)
        if len(text) <= len(surrounding) or (text.endswith("\ufffd") and not final):
            return ""
        delta = text[len(surrounding) :]
        st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)
        st.sent += delta
        return delta

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip)
