"""The scheduler role: a busy loop that drains requests, admits prefills within
the KV budget, runs decode steps, and streams token ids to the detokenizer.

It owns the model runner, the KV pools and the radix cache, and the request
state the loop's parts share: the loop and its input live here, with the request
ends (finish, release) and KV allocation; admission is sgl.sched.prefill_adder's,
decode steps and retraction sgl.sched.decode's, launching and collecting a batch
sgl.sched.stepping's, a step's results and the outbox sgl.sched.results'. It
never talks to the caller directly and never decodes text.
Bad input finishes that request with an abort reason, and a batch that fails (in
building, prepare, the forward, or its results) ends that batch's requests with one
(sgl.sched.results.fail_batch): neither takes the loop down. Retraction keeps the
loop live (the argument is in sgl.sched.decode); past max_queued_requests waiting,
a new request is refused at once with an abort reason that carries status_code 503."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import torch

from sgl.cache.beam_tails import BeamTails
from sgl.cache.radix_cache import RadixCache
from sgl.core.log import get_logger
from sgl.core.logit_processor import resolve
from sgl.core.protocol import (
    AbortReq,
    AttachReq,
    DetachReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    Message,
    ShutdownReq,
)
from sgl.core.request_checks import RequestLimits, request_error
from sgl.core.server_args import ServerArgs
from sgl.sched.batch import ScheduleBatch
from sgl.sched.beam import release_beams
from sgl.sched.decode import INIT_NEW_TOKEN_RATIO, decode_batch
from sgl.sched.grammar import Grammars, admit_compiled
from sgl.sched.models.parallel import TPGroup
from sgl.sched.prefill_adder import PrefillAdder, prefill_batch, prompt_logprob_rows
from sgl.sched.req import Req
from sgl.sched.results import error_message, start_logprobs, token_id_output
from sgl.sched.runner.model_runner import ModelRunner, eos_ids_of
from sgl.sched.runner.step import Deferred, Launched
from sgl.sched.stepping import collect, collect_and_start, launch, sample_pending
from sgl.sched.stop import StopStrings
from sgl.sched.trie_store import TrieStore, constrain
from sgl.transports.channel import Receiver, Sender

IDLE_POLL_S = 0.5
# With only grammars compiling, the loop waits this long on its input per turn: polling held
# the GIL against the compile thread, whose tokenizer loading and imports are Python.
GRAMMAR_POLL_S = 0.001


class Scheduler:
    def __init__(self, args: ServerArgs, model_path: str, recv: Receiver, send: Sender,
                 tp: TPGroup = TPGroup()) -> None:  # tp: this rank's group (channels: sgl.sched.tp_channels)
        self.args = args
        self.log = get_logger("scheduler", **({"tp_rank": tp.rank} if tp.size > 1 else {}))
        self.recv = recv
        self.send = send
        self.runner = ModelRunner(args, model_path, tp)
        self.pool = self.runner.req_to_token_pool
        self.allocator = self.runner.allocator
        self.tree = RadixCache(self.pool, self.allocator, disable=args.disable_radix_cache)
        self.beam_tails = BeamTails(self.allocator)
        self.tries = TrieStore()
        self.eos_ids = eos_ids_of(self.runner.config, model_path)
        self.runner.eos_ids = frozenset(self.eos_ids)
        # Every allowed processor is imported at startup: a bad entry fails the engine's start.
        self.runner.processors = {name: resolve(name) for name in args.custom_logit_processors}
        tok_path = None if args.skip_tokenizer_init else args.model_files(model_path).tokenizer_path
        self.stop_strings = StopStrings(tok_path, args.trust_remote_code)
        self.grammars = Grammars(tok_path, self.runner.vocab_size, self.eos_ids, args.trust_remote_code,
                                 enabled=args.grammar_backend != "none", tp=tp)
        r = self.runner
        self.limits = RequestLimits(r.vocab_size, r.context_length, r.max_total_tokens, self.stop_strings.available,
                                    tuple(args.custom_logit_processors), args.max_top_logprobs_num,
                                    max_running_requests=r.max_running_requests)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.prefilling: set[Req] = set()  # admitted, last prefill chunk not processed yet
        self.rids: dict[str, Req] = {}
        # Arrival order of the live requests: retraction takes the youngest KV holder (sgl.sched.decode).
        self.arrival: dict[Req, int] = {}
        self._arrivals = itertools.count()
        self.oom_retried: set[Req] = set()  # retracted once after a CUDA OOM: the next one aborts them
        # The batch being built, aborted if building it fails: a decode batch's requests, or an admission round.
        self.building: list[Req] = []
        self.adder: PrefillAdder | None = None
        self.outbox: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO  # see sgl.sched.decode
        self.chunk_size = self.runner.chunked_prefill_size or self.runner.context_length
        self.logprob_rows = prompt_logprob_rows(self.runner.vocab_size, self.chunk_size)
        self.strict = os.environ.get("SGL_STRICT_INVARIANTS") == "1"
        self.invariant_violations = 0
        self.checked_idle = False
        self.overlap = self.runner.overlap
        self.pending: tuple[ScheduleBatch, Launched] | None = None  # launched, results not processed yet
        # Loop time split: building and launching batches, waiting for results, processing them;
        # mask_wait_s: of the building, waiting for grammar bitmasks and queueing their sampling.
        # failures: batches and requests ended by an internal error.
        self.stats: dict[str, float] = {"prefill_tokens": 0, "decode_steps": 0, "retractions": 0, "cached_tokens": 0,
                                        "failures": 0, "build_s": 0.0, "wait_s": 0.0, "process_s": 0.0,
                                        "mask_wait_s": 0.0}

    def info(self) -> dict[str, Any]:
        r = self.runner
        return {
            "model_path": self.args.model_path, "device": str(r.device), "dtype": str(r.dtype).removeprefix("torch."),
            "kv_dtype": str(r.kv_dtype).removeprefix("torch."), "decode_attention": r.decode_attention,
            "vocab_size": r.vocab_size, "context_length": r.context_length, "max_total_tokens": r.max_total_tokens,
            "max_running_requests": r.max_running_requests, "eos_token_ids": sorted(self.eos_ids),
            "chunked_prefill_size": self.chunk_size, "max_queued_requests": self.args.max_queued_requests,
            "max_top_logprobs_num": self.args.max_top_logprobs_num,
            "kv_free": self.allocator.available_size(), "kv_evictable": self.tree.evictable_size(),
            "kv_protected": self.tree.protected_size(), "grammars_compiling": len(self.grammars.pending),
            "running": len(self.running) + (self.chunked_req is not None), "waiting": len(self.waiting),
            "invariant_violations": self.invariant_violations, **self.stats, **r.gpu_timeline.info(),
            **r.masks.times, "cascade_steps": r.cascade_steps, "startup": r.startup}

    # ---- the loop --------------------------------------------------------------

    def run(self) -> None:
        """The loop, until a ShutdownReq arrives."""
        while self.step(block=True):
            pass

    def close(self) -> None:
        """Stop the scheduler's threads (the runner's forward and mask threads, the grammar compiler's)."""
        self.runner.close()
        self.grammars.close()

    def step(self, block: bool = False) -> bool:
        """One turn of the loop: drain the input (when idle and `block`, waiting up to
        IDLE_POLL_S for it), build and launch the next batch, then process the previous
        batch's results and send what finished or streamed. With overlap, batch N+1 is
        launched before batch N's results are processed; without it, each batch is
        processed in the turn that launched it. A batch with grammar rows has its masks
        filled once the previous step's tokens are on the host (its forward runs
        meanwhile), on a thread while those are processed and the next batch is built and
        prepared, and its sampling queued before the next forward (sgl.sched.stepping).
        False once a ShutdownReq was handled."""
        if self.waiting or self.running or self.chunked_req or self.pending:
            msgs = self.recv.recv_all_nowait()
        else:
            compiling = bool(self.grammars.pending)
            if not compiling:
                self._on_idle()
            first = self.recv.recv((GRAMMAR_POLL_S if compiling else IDLE_POLL_S) if block else 0)
            msgs = [first, *self.recv.recv_all_nowait()] if first is not None else []
        for msg in msgs:
            if isinstance(msg, ShutdownReq):
                if self.pending is not None:
                    collect(self, *self.pending)
                self.send.send(msg)
                return False
            self.handle(msg)
        self._reap_aborts()
        if self.grammars.pending:
            admit_compiled(self)
        t0 = time.perf_counter()
        batch = self._build()
        st = self.stats
        batch, prepared = sample_pending(self, batch)
        launched = launch(self, batch, prepared) if batch is not None else None
        t1 = time.perf_counter()
        if batch is not None and launched is not None and not self.overlap:
            self.pending, launched = (batch, launched), None
        fresh = (batch, launched) if batch is not None and isinstance(launched, Deferred) else None
        t2, launched = collect_and_start(self, fresh, launched, t1)
        self.pending = (batch, launched) if launched is not None and batch is not None else None
        self._flush_outbox()
        t3 = time.perf_counter()
        st["build_s"] += t1 - t0
        st["wait_s"] += t2 - t1
        st["process_s"] += t3 - t2
        return True

    def _next_batch(self) -> ScheduleBatch | None:
        batch = prefill_batch(self)
        if batch is None and self.running:
            batch = decode_batch(self)
        return batch

    def _build(self) -> ScheduleBatch | None:
        """The next batch; if building it raises, the requests it was taking in are aborted."""
        self.building, self.adder = [], None
        try:
            return self._next_batch()
        except Exception as e:  # contained to the batch being built
            a = self.adder
            culprits = self.building or ([*a.admitted, *([a.current] if a.current else [])] if a else [])
            self.stats["failures"] += 1
            self.log.exception("building a batch failed: its requests are aborted", rids=[r.rid for r in culprits])
            for r in dict.fromkeys(culprits):
                self.abort_now(r, error_message("scheduling", e))
            return None

    # ---- input -----------------------------------------------------------------

    def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateReqInput):
            self._add(msg)
        elif isinstance(msg, AbortReq):
            self._abort(msg.rid, "aborted by the client")
        elif isinstance(msg, FlushCacheReq):
            out = self._flush_cache()
            out.origin, out.req_id = msg.origin, msg.req_id
            self.send.send(out)
        elif isinstance(msg, GetServerInfoReq):
            self.send.send(GetServerInfoReqOutput(info=self.info(), origin=msg.origin, req_id=msg.req_id))
        elif isinstance(msg, HealthCheckReq):
            self.send.send(HealthCheckOutput(ok=True, origin=msg.origin, req_id=msg.req_id))
        elif isinstance(msg, (AttachReq, DetachReq)):
            self.send.send(msg)  # routing is the detokenizer's business
        else:
            self.log.warning("ignored unexpected message", type=type(msg).__name__)

    def _add(self, msg: GenerateReqInput) -> None:
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.stream, msg)
        self.checked_idle = False
        error = self._validate(req)
        if error is not None:
            self.finish(req, {"type": "abort", "message": error})
            return
        bound = self.args.max_queued_requests
        if bound is not None and len(self.waiting) >= bound:
            # Refused at once, not queued: the HTTP layer maps status_code to 503.
            self.finish(req, {"type": "abort", "status_code": 503,
                              "message": f"server busy: {len(self.waiting)} queued requests "
                                         f"(max_queued_requests={bound}); retry later"})
            return
        error = constrain(req, self.tries, self.runner) or self.grammars.error(req)
        if error is not None:
            self.finish(req, {"type": "abort", "message": error})
            return
        start_logprobs(req)
        if req.prefix_leader is not None and (lead := self.rids.get(req.prefix_leader)) is not None:
            self._share_prompt(lead)
        self.rids[req.rid] = req
        self.arrival[req] = next(self._arrivals)
        if req.prefill_only and not req.needs_input_logprobs:
            self.finish(req, {"type": "length", "length": 0})  # nothing to compute
            return
        if req.sampling_params.grammar is not None:
            self.grammars.submit(req)  # it joins the queue once compiled
            return
        self.waiting.append(req)

    def _validate(self, req: Req) -> str | None:
        if req.rid in self.rids:
            return f"rid: duplicate request id {req.rid!r}: a request with this rid is still running"
        if req.beam is not None and req.stream:
            return "stream: a beam search request cannot stream (its beams are known only at the end)"
        return request_error(req.origin_input_ids, req.sampling_params, req.logprob_start_len, req.top_logprobs_num,
                             req.token_ids_logprob, req.processor, self.limits, return_logprob=req.return_logprob)

    def _share_prompt(self, lead: Req) -> None:
        """n > 1: make the leader's prompt KV reachable through the radix tree for its
        siblings, now if its prompt is already built into a batch, else once it is."""
        if lead.finished or lead.to_abort is not None:
            return
        if lead.req_pool_idx is not None and lead is not self.chunked_req and lead.kv_len >= len(lead.origin_input_ids):
            self.tree.cache_unfinished_req(lead)
        else:
            lead.is_leader = True

    def _abort(self, rid: str, message: str) -> None:
        req = self.rids.get(rid)
        if req is None or req.finished:
            return
        if req in self.waiting or self.grammars.drop(req):
            if req in self.waiting:
                self.waiting.remove(req)
            self.finish(req, {"type": "abort", "message": message})
        else:
            req.to_abort = message  # finished once no launched batch holds it

    def _reap_aborts(self) -> None:
        for req in [*self.running, *([self.chunked_req] if self.chunked_req else [])]:
            if req.to_abort is not None and req.inflight == 0 and not req.finished:
                self.finish(req, {"type": "abort", "message": req.to_abort})

    def _flush_cache(self) -> FlushCacheReqOutput:
        if self.waiting or self.running or self.chunked_req or self.grammars.pending:
            return FlushCacheReqOutput(False, "cannot flush the cache while requests are running or waiting")
        self.tree.reset()
        return FlushCacheReqOutput(True)

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` KV slots, evicting from the radix tree what the free ones lack; None if even that fails."""
        short = n - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc(n)

    # ---- request ends ----------------------------------------------------------

    def release(self, req: Req, cache: bool) -> None:
        """Give back the request's row and KV: into the radix tree, or freed outright
        (a beam request's beams first: its own row then holds the prompt alone)."""
        if req.req_pool_idx is None:
            return
        if req.beam is not None:
            release_beams(self, req)
        if cache:
            self.tree.cache_finished_req(req)
        else:
            row = req.req_pool_idx
            own = self.pool.req_to_token[row, len(req.prefix_indices) : req.kv_len].to(torch.int64)
            self.allocator.free(own)
            self.tree.dec_lock_ref(req.last_node)
            self.pool.free(row)
            req.req_pool_idx = None
        req.prefix_indices = req.prefix_indices[:0]
        req.last_node = None
        req.kv_len = 0

    def finish(self, req: Req, reason: dict[str, Any]) -> None:
        """End a request (not a waiting one: callers drop those first) and give back its KV."""
        req.finished_reason = reason
        self._detach(req)
        self.release(req, cache=reason["type"] != "abort")
        self._forget(req)

    def _detach(self, req: Req) -> None:
        self.prefilling.discard(req)
        if req is self.chunked_req:
            self.chunked_req = None
        if req in self.running:
            self.running.remove(req)

    def _forget(self, req: Req) -> None:
        if self.rids.get(req.rid) is req:
            self.rids.pop(req.rid)
        self.arrival.pop(req, None)
        self.oom_retried.discard(req)
        self.outbox.append(req)

    def abort_now(self, req: Req, message: str) -> None:
        """A failure path: end a live request with an abort reason wherever it is, now,
        even with batches holding it in flight (their results are dropped, as after a
        retraction). If giving its KV back raises, it is ended all the same and the
        idle check will report what leaked."""
        if self.rids.get(req.rid) is not req:
            return  # ended already
        if req in self.waiting:
            self.waiting.remove(req)
        if not req.finished:
            try:
                self.finish(req, {"type": "abort", "message": message})
                return
            except Exception:  # a broken release must not take the loop down
                self.log.exception("giving back an aborted request's KV failed", rid=req.rid)
        self.checked_idle = False
        self._detach(req)
        self._forget(req)

    def _flush_outbox(self) -> None:
        if not self.outbox:
            return
        reqs, self.outbox = list(dict.fromkeys(self.outbox)), []  # once each, even if ended twice over
        self.send.send(token_id_output(reqs))

    # ---- accounting ------------------------------------------------------------

    def _on_idle(self) -> None:
        self.runner.gpu_timeline.reset_gap()
        if self.checked_idle:
            return
        self.checked_idle = True
        try:
            self.tree.check_invariants(None)
            if self.pool.available_size() != self.pool.size:
                raise AssertionError(f"{self.pool.size - self.pool.available_size()} request rows held while idle")
        except AssertionError as e:
            self.invariant_violations += 1
            self.log.error("KV accounting is broken", error=str(e))
            if self.strict:
                raise

