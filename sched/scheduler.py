"""The scheduler role: a busy loop that drains requests, admits prefills within
the KV budget, runs decode steps, and streams token ids to the detokenizer.

It owns the model runner, the KV pools and the radix cache. It never talks to
the caller directly and never decodes text. Bad input finishes that request with
an abort reason; it never takes the loop down."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from sgl.cache.radix_cache import RadixCache
from sgl.core.log import get_logger
from sgl.core.logit_processor import resolve
from sgl.core.protocol import (
    AbortReq,
    AttachReq,
    BatchTokenIDOutput,
    DetachReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    Logprobs,
    Message,
    ShutdownReq,
)
from sgl.core.request_checks import RequestLimits, request_error
from sgl.core.server_args import ServerArgs
from sgl.sched.batch import ScheduleBatch
from sgl.sched.policy import order_waiting
from sgl.sched.req import Req
from sgl.sched.runner.model_runner import Launched, ModelRunner, StepResult
from sgl.sched.stop import StopStrings
from sgl.transports.channel import Receiver, Sender

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
CLIP_MAX_NEW_TOKENS = 4096
IN_BATCH_PREFIX_MIN = 32  # shared tokens beyond the tree's match that make a request wait for a sibling
IDLE_POLL_S = 0.5


class Scheduler:
    def __init__(self, args: ServerArgs, model_path: str, recv: Receiver, send: Sender) -> None:
        self.args = args
        self.log = get_logger("scheduler")
        self.recv = recv
        self.send = send
        self.runner = ModelRunner(args, model_path)
        self.pool = self.runner.req_to_token_pool
        self.allocator = self.runner.allocator
        self.tree = RadixCache(self.pool, self.allocator, disable=args.disable_radix_cache)
        self.eos_ids = _eos_ids(self.runner.config, model_path)
        self.runner.eos_ids = frozenset(self.eos_ids)
        # Every allowed processor is imported at startup: a bad entry fails the engine's start.
        self.runner.processors = {name: resolve(name) for name in args.custom_logit_processors}
        tok_path = None if args.skip_tokenizer_init else (args.tokenizer_path or model_path)
        self.stop_strings = StopStrings(tok_path, args.trust_remote_code)
        r = self.runner
        self.limits = RequestLimits(r.vocab_size, r.context_length, r.max_total_tokens, self.stop_strings.available,
                                    tuple(args.custom_logit_processors))
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.prefilling: set[Req] = set()  # admitted, last prefill chunk not processed yet
        self.rids: dict[str, Req] = {}
        self.outbox: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.chunk_size = args.chunked_prefill_size or self.runner.context_length
        self.strict = os.environ.get("SGL_STRICT_INVARIANTS") == "1"
        self.invariant_violations = 0
        self.checked_idle = False
        self.overlap = self.runner.overlap
        # Loop time split: building and launching batches, waiting for results, processing them.
        self.stats: dict[str, float] = {"prefill_tokens": 0, "decode_steps": 0, "retractions": 0, "cached_tokens": 0,
                                        "build_s": 0.0, "wait_s": 0.0, "process_s": 0.0}

    # ---- info ------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        r = self.runner
        return {
            "model_path": self.args.model_path,
            "device": str(r.device),
            "dtype": str(r.dtype).removeprefix("torch."),
            "vocab_size": r.vocab_size,
            "context_length": r.context_length,
            "max_total_tokens": r.max_total_tokens,
            "max_running_requests": r.max_running_requests,
            "eos_token_ids": sorted(self.eos_ids),
            "kv_free": self.allocator.available_size(),
            "kv_evictable": self.tree.evictable_size(),
            "kv_protected": self.tree.protected_size(),
            "running": len(self.running) + (self.chunked_req is not None),
            "waiting": len(self.waiting),
            "invariant_violations": self.invariant_violations,
            **self.stats,
            "gpu_busy_s": r.gpu_timeline.busy_s,
            "gpu_idle_s": r.gpu_timeline.idle_s,
            "gpu_decode_busy_s": r.gpu_timeline.decode_busy_s,
            "gpu_decode_idle_s": r.gpu_timeline.decode_idle_s,
            "cascade_steps": r.cascade_steps,
        }

    # ---- the loop --------------------------------------------------------------

    def run(self) -> None:
        """The loop. With overlap, batch N+1 is built and launched on the worker before
        batch N's results are processed; without it, each batch is processed at once."""
        pending: tuple[ScheduleBatch, Launched] | None = None
        while True:
            if self.waiting or self.running or self.chunked_req or pending:
                msgs = self.recv.recv_all_nowait()
            else:
                self._on_idle()
                first = self.recv.recv(IDLE_POLL_S)
                msgs = [first, *self.recv.recv_all_nowait()] if first is not None else []
            for msg in msgs:
                if isinstance(msg, ShutdownReq):
                    if pending is not None:
                        pending[1].result()
                    self.send.send(msg)
                    return
                self.handle(msg)
            self._reap_aborts()
            t0 = time.perf_counter()
            batch = self._next_batch()
            launched: Launched | None = None
            if batch is not None:
                prepared = self.runner.prepare(batch)
                for r in batch.reqs:
                    r.inflight += 1
                launched = self.runner.launch(prepared)
            t1 = time.perf_counter()
            if batch is not None and launched is not None and not self.overlap:
                pending, launched = (batch, launched), None
            t2 = t1
            if pending is not None:
                ids = pending[1].result()
                t2 = time.perf_counter()
                self._process(pending[0], ids)
            pending = (batch, launched) if launched is not None and batch is not None else None
            self._flush_outbox()
            t3 = time.perf_counter()
            st = self.stats
            st["build_s"] += t1 - t0
            st["wait_s"] += t2 - t1
            st["process_s"] += t3 - t2

    def _next_batch(self) -> ScheduleBatch | None:
        batch = self._prefill_batch()
        if batch is None and self.running:
            batch = self._decode_batch()
        return batch

    # ---- input -----------------------------------------------------------------

    def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateReqInput):
            self._add(msg)
        elif isinstance(msg, AbortReq):
            self._abort(msg.rid, "aborted by the client")
        elif isinstance(msg, FlushCacheReq):
            out = self._flush_cache()
            out.origin = msg.origin
            self.send.send(out)
        elif isinstance(msg, GetServerInfoReq):
            self.send.send(GetServerInfoReqOutput(info=self.info(), origin=msg.origin))
        elif isinstance(msg, HealthCheckReq):
            self.send.send(HealthCheckOutput(ok=True, origin=msg.origin))
        elif isinstance(msg, (AttachReq, DetachReq)):
            self.send.send(msg)  # routing is the detokenizer's business
        else:
            self.log.warning("ignored unexpected message", type=type(msg).__name__)

    def _add(self, msg: GenerateReqInput) -> None:
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.stream, msg)
        self.checked_idle = False
        error = self._validate(req)
        if error is not None:
            self._finish(req, {"type": "abort", "message": error})
            return
        if req.logprob_start_len == 0 and req.logprobs is not None:
            # The first prompt token has no logprob: SGLang reports it as None.
            lp, first = req.logprobs, req.origin_input_ids[0]
            lp.input_ids.append(first)
            lp.input_vals.append(None)
            if req.top_logprobs_num:
                lp.input_top_vals.append(None)
                lp.input_top_ids.append(None)
            if req.token_ids_logprob:
                lp.input_ids_vals.append(None)
        if req.prefix_leader is not None and (lead := self.rids.get(req.prefix_leader)) is not None:
            self._share_prompt(lead)
        self.rids[req.rid] = req
        if req.prefill_only and not req.needs_input_logprobs:
            self._finish(req, {"type": "length", "length": 0})  # nothing to compute
            return
        self.waiting.append(req)

    def _validate(self, req: Req) -> str | None:
        if req.rid in self.rids:
            return f"rid: duplicate request id {req.rid!r}: a request with this rid is still running"
        return request_error(req.origin_input_ids, req.sampling_params, req.logprob_start_len, req.top_logprobs_num,
                             req.token_ids_logprob, req.processor, self.limits)

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
        if req in self.waiting:
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "message": message})
        else:
            req.to_abort = message  # finished once no launched batch holds it

    def _reap_aborts(self) -> None:
        for req in [*self.running, *([self.chunked_req] if self.chunked_req else [])]:
            if req.to_abort is not None and req.inflight == 0 and not req.finished:
                self._finish(req, {"type": "abort", "message": req.to_abort})

    def _flush_cache(self) -> FlushCacheReqOutput:
        if self.waiting or self.running or self.chunked_req:
            return FlushCacheReqOutput(False, "cannot flush the cache while requests are running or waiting")
        self.tree.reset()
        return FlushCacheReqOutput(True)

    # ---- batching --------------------------------------------------------------

    def _available(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size()

    def _reserved(self) -> int:
        """KV the running requests are expected to still need."""
        return sum(
            int(min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
            for r in self.running
        )

    def _prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        budget = self.args.max_prefill_tokens
        chunk_left = self.chunk_size
        reserved = self._reserved()
        claimed = 0  # tokens admitted this round (allocated after the loop) plus their reserve

        def room() -> int:  # live: locking a matched prefix takes it out of the evictable pool
            return self._available() - reserved - claimed

        admitted: list[Req] = []
        if (req := self.chunked_req) is not None:
            if req.to_abort is not None:
                return None  # finished by _reap_aborts once its last chunk is processed
            # Hand the chunks written so far to the tree (their KV may still be in flight:
            # the worker runs batches in order, so later readers see it written).
            self.tree.cache_unfinished_req(req)
            n = min(req.seq_len - req.kv_len, chunk_left)
            if n > room():
                return None
            req.extend_len = n
            admitted.append(req)
            chunk_left -= n
            budget -= n
            claimed += n
            self.chunked_req = None if req.kv_len + n == req.seq_len else req
        if self.chunked_req is None:
            n_running = len(self.running)
            for req in order_waiting(self.waiting, self.args.schedule_policy, self.tree):
                if chunk_left <= 0 or budget <= 0 or n_running + len(admitted) >= self.runner.max_running_requests:
                    break
                if self.pool.available_size() == 0:
                    break
                if req.prefix_leader is not None and (lead := self.rids.get(req.prefix_leader)) and lead.is_leader:
                    continue  # waits for its leader's prompt to be in the tree
                ids = req.all_ids
                # Prompt logprobs need the logits of the positions they score: no cache hit there.
                limit = min(len(ids) - 1, req.input_logprob_from) if req.needs_input_logprobs else len(ids) - 1
                match = self.tree.match_prefix(ids[:limit])
                if not req.needs_input_logprobs and self._prefix_in_flight(ids, len(match.indices), admitted):
                    continue  # its prefix is being computed: wait a round and reuse it
                todo = len(ids) - len(match.indices)
                n = min(todo, chunk_left)
                future = min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
                need = n + (int(future * self.new_token_ratio) if n == todo else 0)
                # Lock the match first: a locked prefix is no longer evictable room.
                self.tree.inc_lock_ref(match.last_node)
                if (need > room() and (admitted or self.running)) or n > self._available() - claimed:
                    # It waits until running requests finish or retract; alone, it goes
                    # without a reserve as soon as its own tokens fit.
                    self.tree.dec_lock_ref(match.last_node)
                    break
                self._admit(req, match, n)
                admitted.append(req)
                claimed += need
                budget -= n
                chunk_left -= n
                if n < todo:
                    self.chunked_req = req
                    break
            for req in admitted:
                if req in self.waiting:
                    self.waiting.remove(req)
        if not admitted:
            return None
        self.prefilling.update(admitted)
        total = sum(r.extend_len for r in admitted)
        loc = self._alloc(total)
        if loc is None:  # cannot happen: admission kept within available + evictable
            raise RuntimeError(f"KV allocation of {total} failed after admission: free "
                               f"{self.allocator.available_size()}, evictable {self.tree.evictable_size()}, "
                               f"protected {self.tree.protected_size()}, reqs {admitted}")
        self.stats["prefill_tokens"] += total
        batch = ScheduleBatch.extend(admitted, loc, self.pool)
        for req in admitted:
            if req.is_leader and req.kv_len >= len(req.origin_input_ids):
                req.is_leader = False
                self.tree.cache_unfinished_req(req)
        return batch

    def _prefix_in_flight(self, ids: list[int], matched: int, admitted: list[Req]) -> bool:
        """Whether a request being prefilled (this round or in flight) shares a longer
        prefix with `ids` than the radix tree holds now: then waiting for it to be
        cached beats computing the same prefix twice (in-batch prefix caching)."""
        if self.tree.disable:
            return False
        limit = len(ids) - 1
        for other in (*self.prefilling, *admitted):
            o = other.origin_input_ids
            n = min(limit, len(o))
            if n - matched < IN_BATCH_PREFIX_MIN or ids[matched] != o[matched]:
                continue
            if ids[matched : matched + IN_BATCH_PREFIX_MIN] == o[matched : matched + IN_BATCH_PREFIX_MIN]:
                return True
        return False

    def _admit(self, req: Req, match: Any, n: int) -> None:
        req.req_pool_idx = self.pool.alloc()
        prefix = match.indices  # locked by the caller
        req.prefix_indices = prefix
        req.last_node = match.last_node
        if len(prefix):
            self.pool.write(req.req_pool_idx, 0, prefix)
        req.kv_len = len(prefix)
        self.stats["cached_tokens"] += len(prefix)
        req.cached_tokens = max(req.cached_tokens, len(prefix)) if req.retractions == 0 else req.cached_tokens
        req.extend_len = n

    def _alloc(self, n: int) -> torch.Tensor | None:
        short = n - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc(n)

    def _can_step(self, r: Req) -> bool:
        """Whether a running request takes part in the next decode step. Under overlap a
        request whose in-flight token will surely end it (length or context) sits out."""
        if r.to_abort is not None:
            return False
        return (len(r.output_ids) + r.inflight < r.sampling_params.max_new_tokens
                and r.seq_len + r.inflight < self.runner.context_length)

    def _decode_batch(self) -> ScheduleBatch | None:
        while True:
            reqs = [r for r in self.running if self._can_step(r)]
            if not reqs:
                return None
            loc = self._alloc(len(reqs))
            if loc is not None:
                break
            self._retract_one()
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self.stats["decode_steps"] += 1
        return ScheduleBatch.decode(reqs, loc, self.pool)

    def _retract_one(self) -> None:
        """Out of KV in decode: send the request with the least progress back to the queue."""
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self.running.remove(victim)
        self.stats["retractions"] += 1
        if not self.running and not self.waiting:
            # Alone and still out of memory: it can never finish.
            self._finish(victim, {"type": "abort", "message": "out of KV cache memory: the request cannot fit"})
            return
        self._release(victim, cache=False)
        victim.retractions += 1
        victim.epoch += 1
        self.waiting.insert(0, victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        self.log.info("retracted", rid=victim.rid, output_len=len(victim.output_ids))

    # ---- results ---------------------------------------------------------------

    def _process(self, batch: ScheduleBatch, res: StepResult) -> None:
        row = -1  # the last logits row of the previous request
        for i, (req, epoch, partial, tok, (a, k)) in enumerate(zip(
                batch.reqs, batch.epochs, batch.partial, res.next_ids.tolist(), batch.lp_in)):
            req.inflight -= 1
            first, row = row + 1, row + 1 + (k if res.token is not None else 0)
            if req.finished or req.epoch != epoch:
                continue  # ended or retracted after this batch was launched: the token is stale
            if res.errors and i in res.errors and req.to_abort is None:
                req.to_abort = res.errors[i]
            if req.to_abort is not None:
                if req.inflight == 0:
                    self._finish(req, {"type": "abort", "message": req.to_abort})
                continue
            if req.logprobs is not None and res.token is not None:
                self._add_logprobs(req, res, first, a, k, sampled=not partial and not req.prefill_only)
            if partial:
                continue  # a middle prefill chunk samples nothing
            req.prompt_done = True
            if req.prefill_only:
                # Its prompt logprobs are in: the token sampled after the prompt is dropped.
                self._finish(req, {"type": "length", "length": 0})
                continue
            req.output_ids.append(tok)
            reason = self._finish_reason(req, tok)
            if not batch.is_decode:
                self.prefilling.discard(req)
                self.running.append(req)
                if reason is None:
                    self.tree.cache_unfinished_req(req)  # its prompt is shareable while it decodes
            if reason is not None:
                self._finish(req, reason)
            elif req.stream:
                self.outbox.append(req)

    def _add_logprobs(self, req: Req, res: StepResult, first: int, a: int, k: int, sampled: bool) -> None:
        """Append this step's rows [first, first + k) (prompt) and, if `sampled`, first + k
        (the sampled token's) to req.logprobs."""
        lp, end = req.logprobs, first + k + (1 if sampled else 0)
        assert lp is not None and res.token is not None
        vals = res.token[first:end].tolist()
        tops = None
        if req.top_logprobs_num and res.top_vals is not None:
            n = req.top_logprobs_num
            tops = (res.top_vals[first:end, :n].tolist(), res.top_ids[first:end, :n].tolist())  # type: ignore[index]
        ids_vals = None
        if req.token_ids_logprob and res.ids_vals is not None:
            ids_vals = res.ids_vals[first:end, : len(req.token_ids_logprob)].tolist()
        if k:
            lp.input_ids.extend(req.origin_input_ids[a + 1 : a + 1 + k])
            lp.input_vals.extend(vals[:k])
            if tops is not None:
                lp.input_top_vals.extend(tops[0][:k])
                lp.input_top_ids.extend(tops[1][:k])
            if ids_vals is not None:
                lp.input_ids_vals.extend(ids_vals[:k])
        if sampled:
            lp.output_vals.append(vals[k])
            if tops is not None:
                lp.output_top_vals.append(tops[0][k])
                lp.output_top_ids.append(tops[1][k])
            if ids_vals is not None:
                lp.output_ids_vals.append(ids_vals[k])

    def _finish_reason(self, req: Req, tok: int) -> dict[str, Any] | None:
        p = req.sampling_params
        early = len(req.output_ids) <= p.min_new_tokens  # tok itself was masked if so
        if not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids)):
            return {"type": "stop", "matched": tok}
        if not early and p.stop_strs:
            s = self.stop_strings.match(req.output_ids, p.stop_strs, p.skip_special_tokens)
            if s is not None:
                return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if req.seq_len >= self.runner.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _release(self, req: Req, cache: bool) -> None:
        """Give back the request's row and KV: into the radix tree, or freed outright."""
        if req.req_pool_idx is None:
            return
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

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        """End a request (not a waiting one: callers drop those first) and give back its KV."""
        req.finished_reason = reason
        self.prefilling.discard(req)
        if req is self.chunked_req:
            self.chunked_req = None
        elif req in self.running:
            self.running.remove(req)
        self._release(req, cache=reason["type"] != "abort")
        self.rids.pop(req.rid, None)
        self.outbox.append(req)

    def _flush_outbox(self) -> None:
        if not self.outbox:
            return
        reqs, self.outbox = self.outbox, []
        out = BatchTokenIDOutput([], [], [], [], [], [], [], [], [], [], [], [])
        for r in reqs:
            out.rids.append(r.rid)
            out.new_ids.append(r.output_ids[r.sent_len :])
            r.sent_len = len(r.output_ids)
            out.finished_reasons.append(r.finished_reason)
            out.prompt_tokens.append(len(r.origin_input_ids))
            out.completion_tokens.append(len(r.output_ids))
            out.cached_tokens.append(r.cached_tokens)
            out.skip_special_tokens.append(r.sampling_params.skip_special_tokens)
            out.spaces_between_special_tokens.append(r.sampling_params.spaces_between_special_tokens)
            out.no_stop_trim.append(r.sampling_params.no_stop_trim)
            out.stop_strs.append(r.sampling_params.stop_strs)
            out.detokenize.append(r.detokenize)
            out.logprobs.append(r.logprobs)
            if r.logprobs is not None:
                r.logprobs = Logprobs()
        self.send.send(out)

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


def _eos_ids(config: Any, model_path: str) -> set[int]:
    ids: set[int] = set()
    for src in (config, _generation_config(model_path)):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


def _generation_config(model_path: str) -> Any:
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
