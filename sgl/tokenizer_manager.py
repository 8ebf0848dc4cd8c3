"""The tokenizer manager: lives in the caller's event loop. It tokenizes, assigns
request ids, sends requests to the scheduler and routes the detokenizer's
output back to each request's awaiting coroutine.

It runs no threads of its own: its receive task runs on the loop of the first
request. `fail_all` may be called from any thread (the watchdog) and hops onto
that loop.

A tokenizer manager attached from another process (`AsyncEngine.connect`) has a
client id: its rids go on the wire as "<client_id>:<rid>" and its control
requests carry `origin=client_id`, so the detokenizer can route replies to it.
Callers only ever see their own rids."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sgl.log import get_logger
from sgl.metrics import Metrics
from sgl.protocol import (
    AbortReq,
    BatchStrOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    Message,
)
from sgl.sampling_params import SamplingParams
from sgl.transports.channel import ChannelClosed, Receiver, Sender


class EngineDeadError(RuntimeError):
    """The scheduler or detokenizer is gone; no request can complete."""


@dataclass(slots=True)
class _ReqState:
    queue: asyncio.Queue[dict[str, Any] | BaseException]
    created: float
    stream: bool = False
    last_at: float | None = None  # when the previous streamed tokens arrived
    text: str = ""
    output_ids: list[int] = field(default_factory=list)


class TokenizerManager:
    def __init__(self, tokenizer: Any | None, send: Sender, recv: Receiver, context_length: int, vocab_size: int,
                 client_id: str = "", metrics: Metrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.send = send
        self.recv = recv
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.client_id = client_id
        self.rid_prefix = f"{client_id}:" if client_id else ""
        self.metrics = metrics
        self.states: dict[str, _ReqState] = {}
        self.control: dict[type, list[asyncio.Future[Any]]] = {}
        self.dead: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.log = get_logger("tokenizer_manager")

    # ---- requests --------------------------------------------------------------

    def tokenize(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if input_ids is not None:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
                raise ValueError("input_ids must be a list of ints")
            ids = input_ids
        else:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("prompt: this engine was started with skip_tokenizer_init; pass input_ids")
            ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt/input_ids: empty input: a request needs at least one token")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"input_ids: ids must lie in [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt/input_ids: {len(ids)} tokens leave no room in the context length of {self.context_length}")
        return ids

    async def generate(
        self, prompt: str | None, input_ids: list[int] | None, sampling_params: Any, rid: str | None, stream: bool
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield delta chunks when streaming, else one final dict. Aborted on close."""
        params = SamplingParams.coerce(sampling_params)
        ids = self.tokenize(prompt, input_ids)
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"rid must be a str, got {type(rid).__name__}")
        rid = self.rid_prefix + (rid or uuid.uuid4().hex)
        if rid in self.states:
            raise ValueError(f"rid={rid[len(self.rid_prefix):]!r} is already in use by a running request")
        self._ensure_started()
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        st = _ReqState(asyncio.Queue(), time.monotonic(), stream)
        self.states[rid] = st
        finished = False
        try:
            self.send.send(GenerateReqInput(rid, ids, params, stream))
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item["meta_info"]["finish_reason"] is not None
                if stream:
                    yield item
                elif finished:
                    item["text"], item["output_ids"] = st.text, st.output_ids
                    yield item
                if finished:
                    return
        finally:
            self.states.pop(rid, None)
            if not finished and self.dead is None:
                self.send.send(AbortReq(rid))

    def abort(self, rid: str) -> None:
        if self.dead is None:
            self.send.send(AbortReq(self.rid_prefix + rid))

    async def control_call(self, req: Message, reply_type: type) -> Any:
        self._ensure_started()
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.control.setdefault(reply_type, []).append(fut)
        self.send.send(req)
        return await fut

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self.control_call(FlushCacheReq(origin=self.client_id), FlushCacheReqOutput)

    async def server_info(self) -> dict[str, Any]:
        return (await self.control_call(GetServerInfoReq(origin=self.client_id), GetServerInfoReqOutput)).info

    async def health(self) -> bool:
        return (await self.control_call(HealthCheckReq(origin=self.client_id), HealthCheckOutput)).ok

    # ---- receive loop ----------------------------------------------------------

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None:
            self.loop = loop
            self._task = loop.create_task(self._recv_loop())
        elif loop is not self.loop:
            raise RuntimeError("this engine is bound to another event loop: use it from the loop that first used it")

    async def _recv_loop(self) -> None:
        try:
            while True:
                msg = await self.recv.recv_async()
                if isinstance(msg, BatchStrOutput):
                    self._dispatch(msg)
                else:
                    futs = self.control.get(type(msg))
                    if futs:
                        fut = futs.pop(0)
                        if not fut.done():
                            fut.set_result(msg)
        except (ChannelClosed, asyncio.CancelledError):
            pass
        except Exception as e:  # the receive path itself broke: nothing can complete
            self.log.exception("receive loop failed")
            self._fail(EngineDeadError(f"the engine's receive loop failed: {e}"))

    def _dispatch(self, b: BatchStrOutput) -> None:
        now = time.monotonic()
        for i, rid in enumerate(b.rids):
            st = self.states.get(rid)
            if st is None:
                continue  # the caller went away (aborted or cancelled)
            st.text += b.texts[i]
            st.output_ids.extend(b.new_ids[i])
            fin = b.finished_reasons[i]
            if self.metrics is not None:
                self._observe(st, b, i, now)
            meta: dict[str, Any] = {
                "id": rid[len(self.rid_prefix):],
                "prompt_tokens": b.prompt_tokens[i],
                "completion_tokens": b.completion_tokens[i],
                "cached_tokens": b.cached_tokens[i],
                "finish_reason": fin,
            }
            if fin is not None:
                meta["e2e_latency"] = now - st.created
            st.queue.put_nowait({"text": b.texts[i], "output_ids": b.new_ids[i], "meta_info": meta})

    def _observe(self, st: _ReqState, b: BatchStrOutput, i: int, now: float) -> None:
        assert self.metrics is not None
        n = len(b.new_ids[i])
        if st.stream and n:
            if st.last_at is None:
                self.metrics.first_token(now - st.created)
            else:
                self.metrics.inter_token(now - st.last_at, n)
            st.last_at = now
        fin = b.finished_reasons[i]
        if fin is not None:
            self.metrics.finished(b.prompt_tokens[i], b.completion_tokens[i], b.cached_tokens[i],
                                  now - st.created, fin.get("type") == "abort")

    # ---- failure ---------------------------------------------------------------

    def fail_all(self, error: BaseException) -> None:
        """Thread-safe: fail every pending request and every later one with `error`."""
        loop = self.loop
        if loop is None or loop.is_closed():
            self.dead = error
            return
        try:
            loop.call_soon_threadsafe(self._fail, error)
        except RuntimeError:
            self.dead = error

    def _fail(self, error: BaseException) -> None:
        self.dead = error
        for st in self.states.values():
            st.queue.put_nowait(EngineDeadError(str(error)))
        for futs in self.control.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(error)
        self.control.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
