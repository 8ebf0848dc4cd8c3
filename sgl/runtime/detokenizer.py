"""The detokenizer role: turns the scheduler's token ids into text deltas.

Incremental: each request keeps two offsets into its ids; text is only released
once it no longer ends in an incomplete multi-byte character (U+FFFD), and the
last chunk makes the concatenated stream equal the full decode exactly. A
stream holds back a tail that may begin a stop string until it is resolved; the
final text is trimmed at the matched stop (string or id) unless no_stop_trim.
Requests with detokenize=False cost no decode work. It never sees prompts and
never decides when a request ends. A finished beam-search request comes once, its
beams carrying the ids: each beam is decoded whole into its `text`.

With a fast tokenizer (a `tokenizers.Tokenizer` behind it) each request steps a
`tokenizers` DecodeStream instead, the same two-offset algorithm run in Rust; the
Python offset path stays for slow tokenizers, for options whose decode the
tokenizer does not leave to its backend (found by a probe, e.g. clean-up of
spaces, or spaces_between_special_tokens in a tokenizer that honours it), and for
a stream that fails mid-request. Both paths release the same text.

It is also where the engine's tokenizer lives for the caller's side: a TokenizerCall
(encode a prompt, render a chat template, decode for /detokenize, the vocabulary's
texts) is worked on one of `threads` worker threads (a fast tokenizer releases the
GIL while it encodes, so decoding goes on meanwhile), each answering through its own
sender to the tokenizer manager (a socket belongs to one thread). Those threads end
with the loop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from tokenizers import Tokenizer

from sgl.core.log import get_logger
from sgl.core.protocol import (
    CONTROL_REPLIES,
    AttachReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    Beam,
    DetachReq,
    FinishReason,
    ShutdownReq,
    TokenizerCall,
)
from sgl.core.stop_rule import stop_cut
from sgl.runtime.tokenizer_ops import run_call
from sgl.transports.channel import Receiver, Sender

try:
    from tokenizers.decoders import DecodeStream

    HAVE_DECODE_STREAM = True
except ImportError:  # tokenizers < 0.21: the offset path alone
    HAVE_DECODE_STREAM = False

# Decoded by the tokenizer and by its backend on a probe of these, with special tokens
# around: any clean-up of spaces or special-token spacing the tokenizer adds shows here.
_PROBE = "Hello , world . Isn't it ? Yes ! I 'm , you 're ; we 've it 's do n't ' x ' 日本語 😀 e\u0301"


@dataclass(slots=True)
class _DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    decoded: str = ""  # text decoded so far
    sent: str = ""  # the part of it released (decoded minus a held-back stop-string prefix)
    stream: Any | None = None  # its DecodeStream while on the fast path (the offsets mirror it)


class Detokenizer:
    def __init__(self, tokenizer: Any | None, recv: Receiver, send: Sender,
                 replies: Callable[[], Sender] | None = None, threads: int = 4) -> None:
        self.tokenizer = tokenizer
        self.recv = recv
        self.send = send
        self.replies = replies  # opens a sender to the engine's tokenizer manager (one per worker thread)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._reply_senders: list[Sender] = []
        self._senders_lock = threading.Lock()
        self.states: dict[str, _DecodeState] = {}
        self.log = get_logger("detokenizer")
        backend = getattr(tokenizer, "_tokenizer", None)
        self.backend = backend if HAVE_DECODE_STREAM and isinstance(backend, Tokenizer) else None
        self._streamable: dict[tuple[bool, bool], bool] = {}  # (skip, spaces) -> the probe agreed
        self._list_steps = True  # DecodeStream.step takes a list of ids (recent tokenizers do)

    def info(self) -> dict[str, Any]:
        return {"chat_template": bool(getattr(self.tokenizer, "chat_template", None))}

    def run(self) -> None:
        try:
            while True:
                msg = self.recv.recv()
                if isinstance(msg, ShutdownReq):
                    return
                if isinstance(msg, BatchTokenIDOutput):
                    self.send.send(self.process(msg))
                elif isinstance(msg, TokenizerCall):
                    self._submit(msg)
                elif isinstance(msg, (*CONTROL_REPLIES, AttachReq, DetachReq)):
                    self.send.send(msg)  # the sender (an OutputRouter) routes these
                else:
                    self.log.warning("ignored unexpected message", type=type(msg).__name__)
        finally:
            self._stop_workers()

    # ---- the tokenizer manager's tokenizer work --------------------------------

    def _submit(self, call: TokenizerCall) -> None:
        if self.tokenizer is None or self.replies is None:
            self.log.warning("ignored a tokenizer call: this engine has no tokenizer", op=call.op)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sgl-tokenizer")
        self._pool.submit(self._work, call)

    def _work(self, call: TokenizerCall) -> None:
        out = run_call(self.tokenizer, call)
        send = getattr(self._local, "send", None)
        if send is None:
            assert self.replies is not None
            send = self._local.send = self.replies()
            with self._senders_lock:
                self._reply_senders.append(send)
        try:
            send.send(out)
        except Exception:  # the manager is gone; its call fails on its own timeout
            self.log.exception("could not answer a tokenizer call", op=call.op)

    def _stop_workers(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for s in self._reply_senders:  # their threads are done: closing from here is safe
            s.close()
        self._reply_senders.clear()

    # ---- detokenizing ----------------------------------------------------------

    def process(self, b: BatchTokenIDOutput) -> BatchStrOutput:
        """Each request's new text. A finished beam-search request's beams are decoded
        whole into their own texts (its new_ids are empty, and it never streamed)."""
        beams = b.beams or [None] * len(b.rids)  # every output carries the column, one entry per rid
        texts: list[str] = []
        out_beams: list[list[Beam] | None] = []
        for i, rid in enumerate(b.rids):
            o = _Opts(b.skip_special_tokens[i], b.spaces_between_special_tokens[i], b.no_stop_trim[i], b.stop_strs[i])
            decode = b.detokenize[i] and self.tokenizer is not None
            bs = beams[i]
            if bs is None:
                texts.append(self._step(rid, b.new_ids[i], b.finished_reasons[i], o) if decode else "")
                out_beams.append(None)
                continue
            self.states.pop(rid, None)
            texts.append("")
            out_beams.append([msgspec.structs.replace(x, text=self._beam_text(x, o)) for x in bs] if decode else bs)
        return BatchStrOutput(b.rids, texts, b.new_ids, b.finished_reasons, b.prompt_tokens,
                              b.completion_tokens, b.cached_tokens, b.logprobs, out_beams, b.weight_version,
                              b.embeddings)

    def _beam_text(self, beam: Beam, o: _Opts) -> str:
        """A finished beam's text: its ids decoded, less a matched stop id at the end (as
        `_step` trims a request's; beams match no stop strings)."""
        fin, ids = beam.finish_reason, beam.output_ids
        matched = fin.get("matched") if fin.get("type") == "stop" and not o.no_stop_trim else None
        if isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        return self._decode(ids, o)

    def _step(self, rid: str, new_ids: list[int], fin: FinishReason | None, o: _Opts) -> str:
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = _DecodeState()
            if self.backend is not None and self._can_stream(o):
                st.stream = DecodeStream(skip_special_tokens=o.skip)
        st.ids.extend(new_ids)
        if fin is None:
            if st.stream is None:
                self._delta(st, o, final=False)
            elif new_ids:
                self._stream_delta(st, new_ids, o)
            hold = _held(st.decoded, o.stops) if o.stops else 0
            out = st.decoded[len(st.sent) : len(st.decoded) - hold]
            st.sent += out
            return out
        del self.states[rid]
        matched = fin.get("matched") if fin.get("type") == "stop" and not o.no_stop_trim else None
        ids = st.ids[:-1] if isinstance(matched, int) and st.ids and st.ids[-1] == matched else st.ids
        full = self._decode(ids, o)
        if isinstance(matched, str):
            # Trim at the occurrence that stopped generation (it ends in the last token's
            # text), not at an earlier one, e.g. from before min_new_tokens.
            cut = stop_cut(full, matched, len(self._decode(ids[:-1], o)))
            if cut >= 0:
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

    def _stream_delta(self, st: _DecodeState, new_ids: list[int], o: _Opts) -> None:
        """Step the request's DecodeStream over this batch's ids: all at once, as `_delta`
        takes them (one id at a time where tokenizers' step takes no list). The offsets
        follow each release, so `_delta` can take over at any point."""
        assert st.stream is not None
        try:
            if self._list_steps:
                try:
                    self._released(st, st.stream.step(self.backend, new_ids), len(st.ids))
                    return
                except TypeError:  # rejected before any id went in
                    self._list_steps = False
            start = len(st.ids) - len(new_ids)
            for k, i in enumerate(new_ids):
                self._released(st, st.stream.step(self.backend, i), start + k + 1)
        except Exception as e:  # noqa: BLE001 - e.g. a prefix the backend decodes differently
            self.log.debug("decode stream failed; offset path from here", error=str(e))
            st.stream = None
            self._delta(st, o, final=False)

    @staticmethod
    def _released(st: _DecodeState, text: str | None, end: int) -> None:
        """Text the stream released through id `end`: the offsets move as `_delta` moves them."""
        if text is not None:
            st.decoded += text
            st.prefix_offset, st.read_offset = st.read_offset, end

    def _can_stream(self, o: _Opts) -> bool:
        """Whether the tokenizer's decode is its backend's for these options (cached)."""
        key = (o.skip, o.spaces)
        ok = self._streamable.get(key)
        if ok is None:
            ok = self._streamable[key] = self._probe(o)
        return ok

    def _probe(self, o: _Opts) -> bool:
        assert self.backend is not None and self.tokenizer is not None
        try:
            text = self.tokenizer.encode(_PROBE, add_special_tokens=False)
            specials = [int(i) for i in getattr(self.tokenizer, "all_special_ids", [])][:8]
            ids = [*specials, *text, *specials, *specials[::-1], *text[::-1]]
            return bool(ids) and self._decode(ids, o) == self.backend.decode(ids, skip_special_tokens=o.skip)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be probed keeps the offset path
            return False

    def _decode(self, ids: list[int], o: _Opts) -> str:
        assert self.tokenizer is not None
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
