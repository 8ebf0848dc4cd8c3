"""The tokenizer manager: lives in the caller's event loop. It has prompts
tokenized, assigns request ids, sends requests to the scheduler and routes the
detokenizer's output back to each request's awaiting coroutine.

Its receive task runs on the loop of the first request. Tokenizer work goes to its
`Tokenizing` client (sgl/runtime/tokenizer_client.py: for an engine's own manager,
the tokenizer's process), so none runs on the loop; large logprob batches are
formatted in anyio worker threads under the manager's own CapacityLimiter
(`run_sync`). `fail_all` may be called from any thread (the watchdog) and hops onto
that loop. Control calls (sgl/runtime/control.py) are matched by req_id and time out.

The manager of an engine attached from another process (an AttachedEngine) has a
client id: its rids go on the wire as "<client_id>:<rid>" and its control requests
carry `origin=client_id`, so the detokenizer can route replies to it. Callers only
ever see their own rids.

It must not decode token ids into output text (the detokenizer does) nor decide
when a request ends (the scheduler does). Request options and type checks live in
sgl/runtime/req_options.py, stream merging in sgl/runtime/streams.py, logprob
formatting in sgl/runtime/result_format.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from sgl.core.faults import FaultSpec
from sgl.core.log import get_logger
from sgl.core.protocol import (
    CONTROL_PLANE,
    AbortAllReq,
    AbortReq,
    BatchStrOutput,
    Beam,
    ContinueGenerationReq,
    ControlReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    Message,
    PauseGenerationReq,
    SetFaultsReq,
    SetFaultsReqOutput,
    TokenizerCallOutput,
)
from sgl.core.request_checks import RequestLimits
from sgl.core.sampling_params import INT64_MAX, SamplingParams, is_unicode
from sgl.runtime.control import ControlCalls
from sgl.runtime.dp_router import DataParallelSender
from sgl.runtime.metrics import Metrics
from sgl.runtime.req_options import ReqOptions, check_request, generation_defaults, is_int_list, replace_params
from sgl.runtime.result_format import BEAM_STREAM_ERROR, beam_results, format_logprobs, join_chunks
from sgl.runtime.streams import close_all, gather_first, merge_streams
from sgl.runtime.tokenizer_client import Tokenizing, encode, load_vocab
from sgl.transports.channel import ChannelClosed, Receiver, Sender


class EngineDeadError(RuntimeError):
    """The scheduler or detokenizer is gone; no request can complete."""


class ServerBusyError(RuntimeError):
    """The scheduler's waiting queue is full (max_queued_requests): retry later. Over
    HTTP it is a 503, like any RuntimeError of an engine call."""


@dataclass(slots=True)
class _ReqState:
    queue: asyncio.Queue[dict[str, Any] | BaseException]
    created: float
    opts: ReqOptions
    stream: bool = False
    prompt_tokens: int = 0
    last_at: float | None = None  # when the previous streamed tokens arrived
    cached_tokens: int = 0  # as last reported
    observed: bool = False  # its end is in the metrics: each request's exactly once
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)  # non-streaming: accumulated
    beam: bool = False  # a beam-search request: its result is the list of its beams
    beams: list[Beam] | None = None  # as they arrived with its finish


CONTROL_TIMEOUT_S = 30.0  # flush_cache, server_info: the scheduler answers between batches
# Weight updates and memory release/resume: a checkpoint loads, or a group's broadcast
# runs, before the reply (pause, continue and abort-all take the control timeout).
WEIGHTS_TIMEOUT_S = 600.0
_QUICK_CONTROL = (PauseGenerationReq, ContinueGenerationReq, AbortAllReq)
HEALTH_TIMEOUT_S = 10.0
INLINE_LOGPROBS = 256  # logprob entries of one output batch formatted on the loop
FORMAT_THREADS = 2  # for larger batches' formatting
T = TypeVar("T")


class TokenizerManager:
    def __init__(self, tok: Tokenizing | None, send: Sender, recv: Receiver, limits: RequestLimits,
                 model_path: str | None = None, client_id: str = "", metrics: Metrics | None = None,
                 control_timeout: float = CONTROL_TIMEOUT_S, health_timeout: float = HEALTH_TIMEOUT_S,
                 weights_timeout: float = WEIGHTS_TIMEOUT_S) -> None:
        self.tok = tok  # None: skip_tokenizer_init (ids in, ids out)
        if tok is not None:
            tok.guard = self._guard
        self.defaults = generation_defaults(model_path)
        self.limits = limits
        self.send = send
        self.recv = recv
        self.client_id = client_id
        self.rid_prefix = f"{client_id}:" if client_id else ""
        self.metrics = metrics
        self.states: dict[str, _ReqState] = {}
        self.samples: dict[str, list[str]] = {}  # an n > 1 request's rid: its samples' rids
        self.control_timeout = control_timeout
        self.health_timeout = health_timeout
        self.weights_timeout = weights_timeout
        dp = send if isinstance(send, DataParallelSender) else None  # replicas: calls fan out, loads are counted
        self.control = ControlCalls(send, control_timeout, len(dp.replicas) if dp else 1, dp.merge if dp else None)
        self.ended: Callable[[str], None] = dp.finished if dp else lambda rid: None
        self.limiter = anyio.CapacityLimiter(FORMAT_THREADS)  # this manager's formatting threads
        self.dead: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.log = get_logger("tokenizer_manager")

    # ---- requests --------------------------------------------------------------

    def has_tokenizer(self, field: str) -> Tokenizing:
        """The tokenizer client; ValueError naming `field` under skip_tokenizer_init."""
        if self.tok is None:
            raise ValueError(f"{field}: this engine was started with skip_tokenizer_init; pass input_ids")
        return self.tok

    async def tokenize(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        """The request's prompt ids: `input_ids` checked, or `prompt` encoded by the tokenizer's
        worker (exactly one is given: the engine's calls check, sgl.engine.batch_args)."""
        if input_ids is not None:
            if not is_int_list(input_ids):
                raise ValueError("input_ids must be a list of ints")
            return input_ids
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
        if not is_unicode(prompt):
            raise ValueError("prompt is not valid Unicode text: it holds a lone surrogate")
        return (await encode(self.has_tokenizer("prompt"), [prompt]))[0]

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work (a large logprob batch's formatting) in one of this
        manager's worker threads, keeping the event loop free."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def generate(
        self, prompt: str | None, input_ids: list[int] | None, sampling_params: Any, rid: str | None, stream: bool,
        opts: ReqOptions | None = None,
    ) -> AsyncGenerator[Any, None]:
        """Yield delta chunks when streaming, else one final dict. Aborted on close.
        n > 1: one list of n final dicts, or chunks from all samples, each with its "index".
        beam_width >= 1: one list of the beams' final dicts, best first; never streamed."""
        opts = opts or ReqOptions()
        params = SamplingParams.coerce(sampling_params, self.defaults)
        ids = await self.tokenize(prompt, input_ids)
        check_request(ids, params, opts, self.limits)
        if opts.return_text_in_logprobs and self.tok is not None:
            await load_vocab(self.tok, self.limits.vocab_size)  # once: the receive loop reads it
        rid = self._wire_rid(rid)
        if not isinstance(stream, bool):
            raise ValueError(f"stream={stream!r} is invalid: must be a bool")
        if stream and params.beam_width:
            raise ValueError(BEAM_STREAM_ERROR)
        if params.n == 1:
            gen = self._one(self._submit(rid, ids, params, stream, opts, None), stream)
            try:
                async for item in gen:
                    yield item
            finally:
                await gen.aclose()
            return
        # Sample 0 prefills the prompt; the others reuse its KV through the radix cache.
        # Sample i draws with seed + i (wrapped within the seeds' 63 bits), so seeded samples
        # differ but are reproducible.
        if rid in self.samples:
            raise self._in_use(rid)
        rids = self.samples[rid] = [f"{rid}-{i}" for i in range(params.n)]  # abort(rid) reaches them all
        gens: list[AsyncGenerator[dict[str, Any], None]] = []
        try:
            for i, r in enumerate(rids):
                seed = None if params.seed is None else (params.seed + i) % (INT64_MAX + 1)
                p = replace_params(params, n=1, seed=seed)
                gens.append(self._one(self._submit(r, ids, p, stream, opts, rids[0] if i else None), stream))
        except BaseException:
            self._forget(rid, len(gens))
            raise
        if stream:
            merged = merge_streams(gens)
            try:
                async for item in merged:
                    yield item
            finally:
                await merged.aclose()
                self._forget(rid)
            return
        try:
            yield await gather_first(gens)
        finally:
            await close_all(gens)
            self._forget(rid)

    async def encode(self, prompt: str | None, input_ids: list[int] | None, rid: str | None) -> dict[str, Any]:
        """One prompt's embedding request: its final dict, whose "embedding" holds the
        vector as little-endian float32 bytes. The scheduler pools the prompt's final
        hidden states as the model's files say (sgl.sched.models.pooling)."""
        params = SamplingParams(max_new_tokens=0)
        opts = ReqOptions(detokenize=False)
        ids = await self.tokenize(prompt, input_ids)
        check_request(ids, params, opts, self.limits)
        full = self._wire_rid(rid)
        gen = self._one(self._submit(full, ids, params, False, opts, None, embed=True), False)
        try:
            out: dict[str, Any] = await gen.__anext__()
        finally:
            await gen.aclose()
        fin = out["meta_info"]["finish_reason"]
        if "embedding" not in out:
            raise RuntimeError(f"the embedding request ended without its embedding: {fin}")
        return out

    def _wire_rid(self, rid: str | None) -> str:
        """The rid the scheduler knows the request by: the caller's (checked) or a fresh one."""
        if rid is not None and not (isinstance(rid, str) and is_unicode(rid)):
            raise ValueError(f"rid must be a str of valid Unicode text, got {rid!r}")
        return self.rid_prefix + (rid or uuid.uuid4().hex)

    def _in_use(self, rid: str) -> ValueError:
        return ValueError(f"rid={rid[len(self.rid_prefix):]!r} is already in use by a running request")

    def _forget(self, rid: str, submitted: int | None = None) -> None:
        """An n > 1 request's end: abort its samples (the first `submitted`, default all)
        whose generator never ran to its end (or never started)."""
        for r in self.samples.pop(rid, [])[:submitted]:
            if (st := self.states.pop(r, None)) is not None:
                self._observe_abandoned(st)
                self.abort(r)
                self.ended(r)

    def _submit(self, rid: str, ids: list[int], params: SamplingParams, stream: bool, opts: ReqOptions,
                leader: str | None, embed: bool = False) -> str:
        if rid in self.states:
            raise self._in_use(rid)
        self._ensure_started()
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        self.states[rid] = _ReqState(asyncio.Queue(), time.monotonic(), opts, stream, len(ids),
                                     beam=params.beam_width > 0)
        try:
            self.send.send(GenerateReqInput(
                rid, ids, params, stream, opts.return_logprob, opts.logprob_start_len, opts.top_logprobs_num,
                opts.token_ids_logprob, opts.custom_logit_processor, opts.detokenize, leader, embed, opts.priority,
                None if opts.timeout is None else float(opts.timeout), lora_path=opts.lora_path))
        except BaseException:  # never sent (a field the wire cannot carry): nothing of it stays open
            del self.states[rid]
            self.ended(rid)
            raise
        return rid

    async def _one(self, rid: str, stream: bool) -> AsyncGenerator[Any, None]:  # a beam request: a list
        """The request's chunks (stream) or its result. A stream's chunks that arrived while
        its reader was busy come as one: a reader behind the engine (an HTTP stream under
        load) catches up in one step rather than one chunk per step it missed."""
        st = self.states[rid]
        finished = False
        failed: BaseException | None = None  # came after chunks joined into the last one
        try:
            while True:
                item = failed or await st.queue.get()
                if stream and not isinstance(item, BaseException):
                    while item["meta_info"]["finish_reason"] is None and not st.queue.empty():
                        later = st.queue.get_nowait()
                        if isinstance(later, BaseException):
                            failed = later
                            break
                        item = join_chunks(item, later)
                if isinstance(item, BaseException):
                    raise item
                fin = item["meta_info"]["finish_reason"]
                finished = fin is not None
                if finished and fin.get("status_code") == 503:
                    raise ServerBusyError(fin["message"])  # refused before it ran: nothing to return
                if finished and fin.get("status_code") == 400:
                    raise ValueError(fin["message"])  # the scheduler found the request invalid (a grammar)
                if stream:
                    yield item
                elif finished:
                    item["text"], item["output_ids"] = st.text, st.output_ids
                    item["meta_info"].update(st.logprobs)
                    yield beam_results(st.beams, item) if st.beam else item
                if finished:
                    return
        finally:
            if (gone := self.states.pop(rid, None)) is not None:
                self._observe_abandoned(gone)
            if not finished and self.dead is None:
                self.send.send(AbortReq(rid))
            self.ended(rid)

    def abort(self, rid: str) -> None:
        """Abort a request; for n > 1 the rid the caller gave aborts all its samples (and
        nothing else: another request's rid may end in "-1" too)."""
        if self.dead is None:
            full = self.rid_prefix + rid
            self.send.send(AbortReq(full))
            for r in self.samples.get(full, ()):
                self.send.send(AbortReq(r))

    async def control_call(self, req: Message, reply_type: type, timeout: float | None = None) -> Any:
        """Send a control request and await its reply (sgl/runtime/control.py); raise
        TimeoutError naming the call after `timeout` seconds (control_timeout by default)."""
        self._guard()
        return await self.control.call(req, reply_type, timeout)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self.control_call(FlushCacheReq(origin=self.client_id), FlushCacheReqOutput)

    async def server_info(self) -> dict[str, Any]:
        return (await self.control_call(GetServerInfoReq(origin=self.client_id), GetServerInfoReqOutput)).info

    async def health(self) -> bool:
        return (await self.control_call(HealthCheckReq(origin=self.client_id), HealthCheckOutput,
                                        self.health_timeout)).ok

    async def control_plane(self, req: Message) -> ControlReqOutput:
        """Send a control-plane request (protocol.CONTROL_PLANE) as this manager's and await
        its ControlReqOutput: within the control timeout for pause, continue and abort-all,
        `weights_timeout` for the others."""
        assert isinstance(req, CONTROL_PLANE), type(req).__name__
        req.origin = self.client_id
        timeout = self.control_timeout if isinstance(req, _QUICK_CONTROL) else self.weights_timeout
        try:
            return await self.control_call(req, ControlReqOutput, timeout)
        except TimeoutError as e:
            if not self.client_id:
                raise
            # An attached client's refused request is dropped without a reply: say so.
            raise TimeoutError(f"{e}. Under CURVE keys the scheduler acts on control-plane requests only from an "
                               "admin key (the server's DIR/admin/) and drops any other's without a reply, counting "
                               "it in get_server_info()['transport_refused_policy']") from None

    async def set_faults(self, faults: list[FaultSpec] | None) -> SetFaultsReqOutput:
        """Install a fault plan on the scheduler (every replica and rank), or remove it (None)."""
        return await self.control_call(SetFaultsReq(faults, origin=self.client_id), SetFaultsReqOutput)

    # ---- receive loop ----------------------------------------------------------

    def _guard(self) -> None:
        """Before a call whose reply the receive loop brings: start it; refuse once dead."""
        self._ensure_started()
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))

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
                    lps = msg.logprobs
                    if sum(len(lp.output_vals) + len(lp.input_vals) for lp in lps if lp is not None) > INLINE_LOGPROBS:
                        self._dispatch(msg, await self.run_sync(self._format_all, msg))
                    else:
                        self._dispatch(msg, self._format_all(msg))
                elif isinstance(msg, TokenizerCallOutput):
                    if self.tok is not None:
                        self.tok.reply(msg)
                else:
                    self.control.reply(msg)
        except (ChannelClosed, asyncio.CancelledError):
            pass
        except Exception as e:  # the receive path itself broke: nothing can complete
            self.log.exception("receive loop failed")
            self._fail(EngineDeadError(f"the engine's receive loop failed: {e}"))

    def _format_all(self, b: BatchStrOutput) -> list[dict[str, list[Any]] | None]:
        """Each output's logprob lists (None: none asked, or its caller went away)."""
        out: list[dict[str, list[Any]] | None] = []
        vocab = self.tok.vocab if self.tok is not None else None
        for i, rid in enumerate(b.rids):
            st, lp = self.states.get(rid), b.logprobs[i]
            out.append(None if st is None or lp is None else format_logprobs(lp, b.new_ids[i], st.opts, vocab))
        return out

    def _dispatch(self, b: BatchStrOutput, deltas: list[dict[str, list[Any]] | None]) -> None:
        now = time.monotonic()
        beams = b.beams
        made = 0  # tokens for callers still waiting: the throughput gauge's, counted once a batch
        for i, rid in enumerate(b.rids):
            st = self.states.get(rid)
            if st is None:
                continue  # the caller went away (aborted or cancelled)
            made += len(b.new_ids[i])
            if beams and beams[i] is not None:
                st.beams = beams[i]
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
                "weight_version": b.weight_version,
            }
            if fin is not None:
                meta["e2e_latency"] = now - st.created
            if (delta := deltas[i]) is not None:
                for k, v in delta.items():
                    st.logprobs.setdefault(k, []).extend(v)
                meta.update(delta)
            item = {"text": b.texts[i], "output_ids": b.new_ids[i], "meta_info": meta}
            if b.embeddings and (vec := b.embeddings[i]) is not None:
                item["embedding"] = vec  # float32 bytes: the caller's side shapes them (sgl.runtime.embeddings)
            st.queue.put_nowait(item)
        if made and self.metrics is not None:
            self.metrics.generated(made, now)

    def _observe(self, st: _ReqState, b: BatchStrOutput, i: int, now: float) -> None:
        """A request's output in the metrics. Only a streamed request's tokens arrive as they
        are made, so only its time to first token and inter-token latencies are observed (a
        request not streamed arrives whole: it counts in the end-to-end latency)."""
        assert self.metrics is not None
        n = len(b.new_ids[i])
        st.cached_tokens = b.cached_tokens[i]
        if n and st.stream:
            if st.last_at is None:
                self.metrics.first_token(now - st.created)
                n -= 1
            if n:
                self.metrics.inter_token(now - st.last_at if st.last_at is not None else 0.0, n)
            st.last_at = now
        fin = b.finished_reasons[i]
        if fin is not None and not st.observed:
            st.observed = True
            self.metrics.finished(b.prompt_tokens[i], b.completion_tokens[i], b.cached_tokens[i],
                                  now - st.created, fin.get("type") or "abort")

    def _observe_abandoned(self, st: _ReqState) -> None:
        """A request that ended before its finish arrived (its caller went away, or the
        engine failed): an abort, with the tokens it had."""
        if self.metrics is None or st.observed:
            return
        st.observed = True
        self.metrics.finished(st.prompt_tokens, len(st.output_ids), st.cached_tokens, time.monotonic() - st.created,
                              "abort")

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

    def fail_requests(self, message: str, error_type: type[Exception] = RuntimeError) -> None:
        """On the loop: end every open request with an `error_type(message)` of its own,
        without marking the engine dead (a server stopping). Each is aborted in the
        scheduler as its generator closes."""
        for st in self.states.values():
            st.queue.put_nowait(error_type(message))

    def _fail(self, error: BaseException) -> None:
        self.dead = error
        self.fail_requests(str(error), EngineDeadError)
        self.control.fail(error)
        if self.tok is not None:
            self.tok.fail(error)

    def close_channels(self, error: BaseException) -> None:
        """Once the engine stopped (from any thread): fail every pending and later call with
        `error`, and close the channels and the tokenizer client."""
        self.fail_all(error)
        self.send.close()
        self.recv.close()
        if self.tok is not None:
            self.tok.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

