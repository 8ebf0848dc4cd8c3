"""The scheduler role: a loop that takes requests in, admits prefills within the KV
budget, runs decode steps, and streams token ids to the detokenizer.

Each turn (`step`) reads top to bottom: receive, schedule the next batch, launch it,
process the previous batch's results, send. With the overlap loop (the default on a
GPU) batch N+1 is launched before batch N's results are processed, so the host's
work hides behind the GPU's; without it each batch is processed in the turn that
launched it. The state lives with its owners: the waiting queue and admission
(sgl.sched.prefill), the running set, decode steps and retraction (sgl.sched.decode),
KV ownership (sgl.sched.kv_cache), grammars (sgl.sched.grammar), a new request's
checks (sgl.sched.intake), results and failures (sgl.sched.results), a test's planted
faults (sgl.sched.faults), deadlines (sgl.sched.deadlines); the model, its pools and
sampling are the runner's
(sgl.sched.runner). The scheduler itself holds the live requests by rid and ends them
(`finish`, `abort_now`).

Bad input ends that request with an abort reason, and a batch that fails (building,
prepare, the forward, sampling or its results) ends that batch's requests: neither
takes the loop down. It never talks to the caller directly and never decodes text."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sgl.core.faults import Busy, ControlCall
from sgl.core.log import get_logger
from sgl.core.protocol import (
    CONTROL_PLANE,
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
    SetFaultsReq,
    SetFaultsReqOutput,
    ShutdownReq,
)
from sgl.core.server_args import ServerArgs
from sgl.sched.batch import ScheduleBatch
from sgl.sched.beam import BeamSearch
from sgl.sched.control import ControlPlane
from sgl.sched.deadlines import Deadlines, deadline_message
from sgl.sched.decode import DecodeManager
from sgl.sched.faults import FaultInjector
from sgl.sched.grammar import Grammars
from sgl.sched.intake import RequestIntake
from sgl.sched.kv_cache import KVCache
from sgl.sched.lora import LoraManager
from sgl.sched.models.parallel import TPGroup
from sgl.sched.prefill import PrefillManager
from sgl.sched.req import Req
from sgl.sched.results import Outbox, ResultProcessor, error_message
from sgl.sched.runner.model_runner import ModelRunner
from sgl.sched.runner.step import Step
from sgl.sched.speculative import Speculator
from sgl.sched.stop import StopStrings
from sgl.transports.channel import Receiver, Sender

IDLE_POLL_S = 0.5
CONTROL_CALLS: dict[type, ControlCall] = {FlushCacheReq: "flush_cache", GetServerInfoReq: "server_info",
                                          HealthCheckReq: "health"}
# With only grammars compiling, the loop waits this long on its input per turn: polling held
# the GIL against the compile thread, whose tokenizer loading and imports are Python.
GRAMMAR_POLL_S = 0.001


class Scheduler:
    def __init__(self, args: ServerArgs, model_path: str, recv: Receiver, send: Sender,
                 tp: TPGroup = TPGroup(),  # this rank's group (channels: sgl.sched.tp_channels)
                 clock: Callable[[], float] = time.monotonic) -> None:  # deadlines' (a test's own)
        self.args = args
        self.log = get_logger("scheduler", **({"tp_rank": tp.rank} if tp.size > 1 else {}))
        self.recv = recv
        self.send = send
        self.runner = r = ModelRunner(args, model_path, tp)
        tok_path = None if args.skip_tokenizer_init else args.model_files(model_path).tokenizer_path
        self.kv = KVCache(r.req_to_token_pool, r.allocator, args.disable_radix_cache)
        self.lora = LoraManager(r, args) if r.lora_spec is not None else None
        self.grammars = Grammars(tok_path, r.vocab_size, set(r.eos_ids), args.trust_remote_code,
                                 enabled=args.grammar_backend != "none", tp=tp)
        self.speculator = (Speculator(args, r.chunked_prefill_size or r.context_length, tp)
                           if args.speculative_algorithm is not None else None)
        self.intake = RequestIntake(r, self.grammars, tok_path is not None, tuple(args.custom_logit_processors),
                                    args.max_top_logprobs_num, args.max_queued_requests, self.lora)
        self.prefill = PrefillManager(self.kv, policy=args.schedule_policy, max_prefill_tokens=args.max_prefill_tokens,
                                      chunk_size=r.chunked_prefill_size or r.context_length, vocab_size=r.vocab_size,
                                      max_running_requests=r.max_running_requests, lora=self.lora)
        self.decode = DecodeManager(self.kv, self.prefill, r.context_length, self.finish, self.speculator,
                                    r.graph_bs)
        self.faults = FaultInjector(self.prefill, self.decode, self.grammars, self._queue, self._abort, tp.size)
        self.deadlines = Deadlines(args.request_timeout, clock, tp)
        self.outbox = Outbox()
        self.results = ResultProcessor(self.kv, self.prefill, self.decode,
                                       BeamSearch(self.kv, r.eos_ids, r.context_length, self.finish), self.outbox,
                                       StopStrings(tok_path, args.trust_remote_code), r.eos_ids, r.context_length,
                                       tp.size, self.finish, self.abort_now)
        self.rids: dict[str, Req] = {}  # the live requests: queued, compiling, prefilling or running
        self.last: Step | None = None  # launched, results not processed yet (the overlap loop's)
        self.control = ControlPlane(r, self.kv, self.prefill, self.decode, self.rids, self._drain, self.abort_now,
                                    self.lora)
        # The loop's time: building and launching batches (mask_wait_s of it: queueing a grammar
        # batch's sampling once its masks are in), waiting for results, processing them.
        self.stats = {"build_s": 0.0, "mask_wait_s": 0.0, "wait_s": 0.0, "process_s": 0.0}

    @property
    def idle(self) -> bool:
        """Nothing queued, prefilling, running or in flight (grammars may be compiling)."""
        return not (self.prefill.busy or self.prefill.prefilling or self.decode.running or self.last is not None)

    def info(self) -> dict[str, Any]:
        out = {"model_path": self.args.model_path, "max_queued_requests": self.args.max_queued_requests,
               "max_top_logprobs_num": self.args.max_top_logprobs_num, **self.runner.info(), **self.kv.info(),
               **self.prefill.info(), **self.decode.info(), "grammars_compiling": len(self.grammars.pending),
               "failures": self.results.failures, **self.stats, **self.control.info(), **self.deadlines.stats,
               "deadlines": len(self.deadlines.reqs), **(self.lora.info() if self.lora is not None else {}),
               **(self.speculator.info() if self.speculator is not None else {})}
        out["waiting"] += len(self.faults.delayed)  # held back by a planted fault: waiting all the same
        out["running"] += len(self.faults.hung)
        return out

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
        """One turn: receive, schedule, launch, process the previous batch's results, send.
        A grammar batch's sampling waits for its bitmasks, which fill on a thread from the
        moment the previous step's tokens are on the host (sgl.sched.runner.step.Step): it
        is queued here, after the next batch was built and prepared and before that batch's
        forward, which reads its tokens. False once a ShutdownReq was handled."""
        for msg in self._receive(block):
            if isinstance(msg, ShutdownReq):
                self._drain()
                self.send.send(msg)
                return False
            self.handle(msg)
        for req in self.deadlines.expired():
            self._abort(req, deadline_message(req.timeout or 0.0))
        if self.faults.plan is not None:
            self.faults.step()
        for req, reason in self.grammars.ready():  # compiled: they join the queue, or end
            if reason is None:
                self.prefill.add(req)
            else:
                self.finish(req, reason)
        for req in self.decode.abort_ready():
            self.finish(req, {"type": "abort", "message": req.to_abort})
        for reply in self.control.step():  # weight updates that waited for the running requests
            self._send(reply)
        t0 = time.perf_counter()
        last, self.last = self.last, None
        batch = self._schedule()
        # The new batch's host work goes first, while the last one's masks fill, unless that
        # batch's sampling moves request-table rows (beams), which the new one reads.
        prepare_first = last is None or not last.moves_rows
        prepared = self._guard(batch, "prepare", self.runner.prepare, batch) if batch and prepare_first else None
        if last is not None and last.awaits_sampling:
            t = time.perf_counter()
            last = last if self._guard(last.batch, "sampling", last.sample, launched=True) else None
            self.stats["mask_wait_s"] += time.perf_counter() - t
        if batch and not prepare_first:
            prepared = self._guard(batch, "prepare", self.runner.prepare, batch)
        step = self._guard(batch, "forward", self.runner.launch, prepared) if batch and prepared else None
        if step is not None:
            for r in step.batch.unique_reqs:
                r.inflight += 1
            if not self.runner.overlap:
                last, step = step, None  # processed in this turn
            elif not step.batch.is_decode:
                self.decode.join(step.batch)
        t1 = time.perf_counter()
        if last is not None:  # its results on the host, or None
            got = self.results.wait(last, self.faults.strike if self.faults.plan is not None else None)
        else:
            got = None
        t2 = time.perf_counter()
        if step is not None and step.prepared.grammar is not None:  # its masks fill while `got` is applied
            tokens = got.grammar_tokens() if got is not None else None
            step = step if self._guard(step.batch, "sampling", step.fill_masks, tokens, launched=True) else None
        self.results.apply(got)
        self.last = step
        self._send()
        t3 = time.perf_counter()
        st = self.stats
        st["build_s"] += t1 - t0
        st["wait_s"] += t2 - t1
        st["process_s"] += t3 - t2
        if self.speculator is not None and (last is not None or step is not None):
            self.speculator.pace(t1 - t0 + t3 - t2, t2 - t1)
        return True

    def _receive(self, block: bool) -> list[Message]:
        """The waiting messages. While idle (or paused, nothing in flight) and `block`,
        wait for one up to IDLE_POLL_S (GRAMMAR_POLL_S with grammars compiling; at most
        until the nearest deadline). When truly idle the KV accounting is checked: once
        a wait brought nothing, since the check walks every slot (17 ms for a million on
        one CPU core) and a request sent as the last one ended would wait for it; at once
        under SGL_STRICT_INVARIANTS (tests: a broken balance fails the test that broke it)."""
        idle = self.idle
        if not idle and not (self.control.frozen and self.last is None):
            return self.recv.recv_all_nowait()
        compiling = bool(self.grammars.pending)
        checkable = idle and not compiling and not self.faults.hung  # a hung request keeps its KV
        if idle and not compiling:
            if checkable and self.kv.strict:
                self.kv.check_idle()
            self.runner.gpu_timeline.reset_gap()
        timeout = (GRAMMAR_POLL_S if compiling else IDLE_POLL_S) if block else 0
        for due in (self.faults.first_due_s(), self.deadlines.next_in()):
            if due is not None:
                timeout = min(timeout, due)
        first = self.recv.recv(timeout)
        if first is None and checkable and timeout > 0:
            self.kv.check_idle()
        return [first, *self.recv.recv_all_nowait()] if first is not None else []

    def _schedule(self) -> ScheduleBatch | None:
        """The next batch: a decode step that a prefill left owed to the running streams
        (DecodeManager.owed_step), else an admission round (with enable_mixed_chunk, its
        forward steps the running requests too), else a decode step of the running
        requests. If building it raises, the requests it was taking in are aborted."""
        if self.control.frozen:
            return None
        builders: tuple[PrefillManager | DecodeManager, ...] = (self.decode,)
        try:
            if self.prefill.busy and (batch := self.decode.owed_step()) is not None:
                return batch
            builders = (self.prefill,)
            mix = self.args.enable_mixed_chunk and self.prefill.busy and self.decode.running
            mixable = self.decode.mixable() if mix else []
            batch = self.prefill.schedule(self.decode.running, self.rids, self.decode.new_token_ratio,
                                          admit=self.control.admits, preemption=self.decode,
                                          decode_rows=len(mixable))
            if batch is not None and mixable:
                builders = (self.prefill, self.decode)
                if (step := self.decode.mixed_step(mixable)) is not None:
                    batch = ScheduleBatch.mixed(batch, step)
            if batch is not None:
                self.decode.prefilled(batch)
            elif self.decode.running:
                builders = (self.decode,)
                batch = self.decode.schedule()
            return batch
        except Exception as e:  # contained to the batch being built
            culprits = [r for b in builders for r in b.building()]
            self.results.failures += 1
            self.log.exception("building a batch failed: its requests are aborted", rids=[r.rid for r in culprits])
            for r in dict.fromkeys(culprits):
                self.abort_now(r, error_message("scheduling", e))
            return None

    def _guard(self, batch: ScheduleBatch, stage: str, call: Any, *args: Any, launched: bool = False) -> Any:
        """`call(*args)`'s result (True for a call that returns nothing); if it raises,
        `batch` fails (its requests end) and the result is None. `launched`: the batch
        counts in its requests' `inflight` until now."""
        try:
            if stage == "prepare" and self.faults.plan is not None:
                self.faults.strike(batch, stage)  # a planted failure (the forward's and the results': at their wait)
            out = call(*args)
            return True if out is None else out
        except Exception as e:  # noqa: BLE001 - contained to this batch
            for r in batch.unique_reqs if launched else ():
                r.inflight -= 1
            self.results.fail(batch, e, stage, kv_written=False)
            return None

    # ---- input -----------------------------------------------------------------

    def handle(self, msg: Message) -> None:
        call = CONTROL_CALLS.get(type(msg)) if self.faults.plan is not None else None
        if call is not None and self.faults.control(call):
            return  # a planted hang: no answer
        if isinstance(msg, GenerateReqInput):
            self._add(msg)
        elif isinstance(msg, AbortReq):
            req = self.rids.get(msg.rid)
            if req is not None and not req.finished:
                self._abort(req, "aborted by the client")
        elif isinstance(msg, FlushCacheReq):
            idle = self.idle and not self.grammars.pending and not (self.faults.delayed or self.faults.hung)
            if idle:
                self.kv.flush()
            out = FlushCacheReqOutput(idle, "" if idle else "cannot flush the cache while requests are running "
                                                             "or waiting")
            out.origin, out.req_id = msg.origin, msg.req_id
            self.send.send(out)
        elif isinstance(msg, GetServerInfoReq):
            self.send.send(GetServerInfoReqOutput(info=self.info(), origin=msg.origin, req_id=msg.req_id))
        elif isinstance(msg, HealthCheckReq):
            self.send.send(HealthCheckOutput(ok=True, origin=msg.origin, req_id=msg.req_id))
        elif isinstance(msg, CONTROL_PLANE):
            if (reply := self.control.handle(msg)) is not None:
                reply.origin, reply.req_id = msg.origin, msg.req_id
                self._send(reply)
        elif isinstance(msg, SetFaultsReq):
            why = self.faults.install(msg.faults)
            self.send.send(SetFaultsReqOutput(why is None, why or "", msg.origin, msg.req_id))
        elif isinstance(msg, (AttachReq, DetachReq)):
            self.send.send(msg)  # routing is the detokenizer's business
        else:
            self.log.warning("ignored unexpected message", type=type(msg).__name__)

    def _add(self, msg: GenerateReqInput) -> None:
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.stream, msg)
        effects = self.faults.arrive(req) if self.faults.plan is not None else None
        busy = effects is not None and any(isinstance(e, Busy) for e in effects)
        refusal = self.control.refusal() or self.intake.check(req, self.rids, len(self.prefill.waiting), busy)
        if refusal is not None:
            self.finish(req, refusal)
            return
        req.start_logprobs()
        if req.prefix_leader is not None and (lead := self.rids.get(req.prefix_leader)) is not None:
            self.prefill.share_prompt(lead)
        self.rids[req.rid] = req
        self.deadlines.add(req)
        if req.prefill_only and not req.needs_input_logprobs and not req.embed:
            self.finish(req, {"type": "length", "length": 0})  # nothing to compute
        elif not (effects and self.faults.accept(req, effects)):  # unless a planted fault holds it back
            self._queue(req)

    def _queue(self, req: Req) -> None:
        """An accepted request joins the queue (a grammar request once compiled)."""
        if req.sampling_params.grammar is not None:
            self.grammars.submit(req)
        else:
            self.prefill.add(req)

    def _abort(self, req: Req, message: str) -> None:
        """End a live request as a client's abort does: now if it has not started (or a
        planted fault holds it), else once no launched batch holds it."""
        if self.prefill.unqueue(req) or self.grammars.drop(req) or self.faults.release(req):
            self.finish(req, {"type": "abort", "message": message})
        else:
            req.to_abort = message

    def _drain(self) -> None:
        """Process the batch in flight, if any: afterwards no launched batch reads the
        weights, the KV pool or a request's state."""
        if self.last is not None:
            last, self.last = self.last, None
            self.results.apply(self.results.wait(last))

    def _send(self, reply: Message | None = None) -> None:
        """Send what the outbox holds, then `reply` (a control reply follows the outputs it caused)."""
        if (out := self.outbox.flush(self.control.weight_version)) is not None:
            self.send.send(out)
        if reply is not None:
            self.send.send(reply)

    # ---- request ends ----------------------------------------------------------

    def finish(self, req: Req, reason: dict[str, Any]) -> None:
        """End a request that is not queued (a queued one is unqueued first) and give back
        its KV (into the tree, unless aborted)."""
        req.finished_reason = reason
        req.end_prompt_logprobs()
        self.prefill.remove(req)
        self.decode.remove(req)
        self.kv.release(req, cache=reason["type"] != "abort")
        self._forget(req)

    def abort_now(self, req: Req, message: str) -> None:
        """A failure path: end a live request with an abort reason wherever it is, now,
        even with batches holding it in flight (their results are dropped, as after a
        retraction). If giving its KV back raises, it is ended all the same and the
        idle check will report what leaked."""
        if self.rids.get(req.rid) is not req:
            return  # ended already
        self.prefill.unqueue(req)  # a failed admission round's requests are still queued
        self.grammars.drop(req)
        self.faults.release(req)
        if not req.finished:
            try:
                self.finish(req, {"type": "abort", "message": message})
                return
            except Exception:  # a broken release must not take the loop down
                self.log.exception("giving back an aborted request's KV failed", rid=req.rid)
        # Its reason is set but its KV release raised (here or in an earlier finish): ended all the same.
        self.prefill.remove(req)
        self.decode.remove(req)
        self._forget(req)

    def _forget(self, req: Req) -> None:
        if self.rids.get(req.rid) is req:
            self.rids.pop(req.rid)
            self.deadlines.discard(req)
        self.outbox.add(req)
