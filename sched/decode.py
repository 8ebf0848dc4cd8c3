"""Decode steps: which running requests take the next step, the KV slots for it,
and retraction when those slots cannot be had. The new-token ratio (the share of
their remaining max_new_tokens that running requests are expected to still need,
which prefill admission reserves) decays with each decode step and rises with
each retraction.

Liveness (why retraction can never leave the scheduler with no request making
progress). The KV holders are the running requests and the admitted ones whose
prompt is not done yet (`PrefillManager.prefilling`, the chunked request among them).
Holders are ranked by seniority (sgl.sched.policy.seniority): by arrival (`Req.arrival`,
older is more senior), under the priority policy by priority first. The victim of a
retraction is always the least senior holder, never the most senior one H while any
other holder exists:
- every request fits the pool alone (prompt + max_new_tokens <= max_total_tokens
  is checked at submit and again by the scheduler), so H alone can always get the
  slot of its next decode step or its next chunk: every other slot is free, in the
  radix tree unlocked (evictable), or held by a younger holder, which retraction
  frees;
- H's tokens are therefore never thrown away while it is the oldest holder, and
  each decode turn gives it one (decode_batch retracts younger holders until its
  slots fit). A blocked chunk of H stops the whole round (PrefillAdder.add_chunked
  first, nothing else admitted), so the running requests, all younger, only
  shrink until the chunk fits;
- under the priority policy a waiting request may preempt (admission retracts running
  requests for it, `victims`), but only requests of strictly lower priority than its
  own, and only when it is then admitted: H is a victim only if the admitted request
  outranks it, which then is the most senior holder. Preemption never cycles: a
  victim can only ever preempt requests of lower priority still;
- H stops being the most senior holder only by finishing or when a request that
  outranks it is admitted, which then has the same guarantee; arrivals are younger
  than every live request, so one outranks H only by a higher priority (the traffic
  the priority policy serves first), and an older one can be re-admitted only
  finitely often.
So some request finishes within a bounded number of turns, whatever the traffic.
DecodeManager never admits prefills and never processes results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sgl.core.log import get_logger
from sgl.sched.batch import ScheduleBatch
from sgl.sched.kv_cache import KVCache
from sgl.sched.policy import seniority
from sgl.sched.prefill import PrefillManager
from sgl.sched.req import Req
from sgl.sched.speculative import Speculator

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step
RETRACT_NEW_TOKEN_RATIO_BUMP = 0.1  # per retraction, up to 1
CANNOT_FIT = "out of KV cache memory: the request cannot fit"


class DecodeManager:
    """The running requests, their decode steps and retraction. `finish` ends a request
    (the scheduler's): a retraction victim with an abort pending ends instead."""

    def __init__(self, kv: KVCache, prefill: PrefillManager, context_length: int,
                 finish: Callable[[Req, dict[str, Any]], None], speculator: Speculator | None = None,
                 max_rows: int | None = None) -> None:
        self.kv = kv
        # Proposes tokens each step verifies (a speculative engine), within max_rows decode rows.
        self.speculator = speculator
        self.max_rows = max_rows
        # The step being built speculates: a speculative engine with few enough running requests.
        self.speculating = False
        self.prefill = prefill
        self.context_length = context_length
        self.finish = finish
        self.log = get_logger("scheduler")
        self.running: list[Req] = []
        self.stepping: list[Req] = []  # the decode batch being built (a failure aborts its requests)
        # The share of their remaining max_new_tokens that running requests are expected to
        # still need, which prefill admission reserves.
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        # A prefill's forward ran while streams were running: the next turn steps them first.
        self.owed = False
        # decode_steps counts mixed_steps too: those a prefill's forward carried. owed_steps:
        # the decode steps taken ahead of a waiting prompt (owed_step).
        self.stats = {"decode_steps": 0, "mixed_steps": 0, "owed_steps": 0, "retractions": 0, "preemptions": 0}

    def add(self, req: Req) -> None:
        """A request whose prompt is done (or launched: `join`) runs; adding one that runs is a no-op."""
        if not req.running:
            req.running = True
            self.running.append(req)

    def remove(self, req: Req) -> None:
        if req.running:
            req.running = False
            self.running.remove(req)

    def join(self, batch: ScheduleBatch) -> None:
        """Under the overlap loop: the requests whose last prompt chunk the just-launched
        prefill `batch` carries run from now on, so the next decode step takes them, its
        input their prefill's token, sampled on the device before it. A stream's second
        token then comes one step after its first, as every later one does; waiting for
        the prefill's results cost a step more. Their prefill's results find them running
        (and a token that ends one makes its entry of that step stale, as for any step in
        flight). Until those results they stay prefilling too: a waiting request that
        shares their prompt waits for it to be cached (PrefillAdder.prefix_in_flight).
        Requests whose next step needs the host first wait for the results: beams, serial
        requests, grammars and trie constraints, prefill-only ones and embeddings."""
        for r, partial in zip(batch.reqs[: batch.decode_start], batch.partial):
            if not (partial or r.steered or r.serial or r.prefill_only or r.pooled is not None):
                self.add(r)

    def prefilled(self, batch: ScheduleBatch) -> None:
        """A prefill batch was built: if it steps no running request while some stream
        (a request whose tokens are sent as they come), the next turn owes them a step."""
        self.owed = batch.decode_from is None and any(r.stream for r in self.running)

    def owed_step(self) -> ScheduleBatch | None:
        """The decode step a prefill left owed to the running streams, taken even with
        prompts waiting; None when none is owed or none can step. A stream so waits out one
        prefill forward between two tokens, never a run of them: prompts that arrive a few
        milliseconds apart would otherwise each take a forward of their own while every
        stream, and the first of them, waited. Requests that are not streamed only care
        about their end, so for them admission goes first (the most tokens a second); at
        most one decode step is taken ahead of a prompt."""
        if not self.owed:
            return None
        batch = self.schedule()
        if batch is not None:
            self.stats["owed_steps"] += 1
        return batch

    def can_step(self, r: Req) -> bool:
        """Whether a running request takes part in the next decode step. Under overlap a
        request whose in-flight tokens will surely end it (length or context) sits out; one
        whose device input is stale (it proposed in its last step), and one about to propose
        (Speculator.waits_for_results), step only once their last step is processed."""
        if r.to_abort is not None:
            return False
        if r.inflight and (r.serial or r.stale_input or self._proposes_next(r)):
            return False
        return r.inflight < r.tokens_left(self.context_length)

    def _proposes_next(self, r: Req) -> bool:
        """An in-flight request that sits out to propose once its results are in."""
        return (self.speculating and self.speculator is not None
                and self.speculator.waits_for_results(r, self.context_length))

    def schedule(self) -> ScheduleBatch | None:
        """The next decode step of the running requests that can step, retracting the
        youngest KV holders until their slots fit; None when none can step."""
        self.stepping = []
        spec = self.speculator
        self.speculating = spec is not None and spec.on_for(len(self.running))
        while True:
            reqs = [r for r in self.running if self.can_step(r)]
            if not reqs:
                return None
            if self.speculating and self._regroup(reqs):
                return None
            self.stepping = reqs
            rows = sum(len(r.rows) for r in reqs)  # a beam request steps every beam
            props = work = None
            if self.speculating:
                assert spec is not None
                props, work = spec.propose(reqs, self.context_length, self.max_rows)
                loc = self.kv.alloc(rows + sum(map(len, props)))
                if loc is not None:
                    break
                # Short of KV: no proposals before any retraction (a draft may still catch up).
                props = [[] for _ in reqs]
            loc = self.kv.alloc(rows)
            if loc is not None:
                break
            self._retract_youngest()  # one holder fewer each time: the loop ends
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self.stats["decode_steps"] += 1
        self.owed = False
        return ScheduleBatch.decode(reqs, loc, self.kv.pool, props, host_inputs=any(r.stale_input for r in reqs),
                                    catch_up=work)

    def _regroup(self, stepping: list[Req]) -> bool:
        """Whether to hold this step back for the step in flight, whose results some
        requests wait for to propose, so that they all verify together next turn
        (Speculator.regroups: the device is the slower side)."""
        spec = self.speculator
        assert spec is not None
        if len(stepping) == len(self.running):
            return False
        if not any(r.inflight and r.to_abort is None and self._proposes_next(r) for r in self.running):
            return False
        if not spec.regroups():  # last: under tensor parallelism, a collective
            return False
        spec.stats["spec_regroups"] += 1
        return True

    def mixable(self) -> list[Req]:
        """The running requests that can step, for a prefill's forward to step too (a mixed
        batch); none when one of them needs a step of its own: beams, grammars and tries
        (their rows and masks), or a speculative step."""
        spec = self.speculator
        self.speculating = spec is not None and spec.on_for(len(self.running))
        if self.speculating:
            return []
        reqs = [r for r in self.running if self.can_step(r)]
        if any(r.steered for r in reqs):
            return []
        return reqs

    def mixed_step(self, mixable: list[Req]) -> ScheduleBatch | None:
        """The decode step that a prefill's forward carries: of the `mixable` requests (taken
        before the admission round) those still running (a preemption retracts some), or
        None when there are none or their slots are not free. It never retracts: the
        youngest KV holder may be a request the prefill just admitted, so short of KV they
        step on their own next turn, where retraction may happen."""
        reqs = self.stepping = [r for r in mixable if r.running]
        loc = self.kv.alloc(sum(len(r.rows) for r in reqs)) if reqs else None
        if loc is None:
            return None
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self.stats["decode_steps"] += 1
        self.stats["mixed_steps"] += 1
        return ScheduleBatch.decode(reqs, loc, self.kv.pool, host_inputs=any(r.stale_input for r in reqs))

    def abort_ready(self) -> list[Req]:
        """The KV holders whose abort is pending and which no launched batch holds: they end now."""
        return [r for r in self.holders() if r.to_abort is not None and r.inflight == 0]

    def building(self) -> list[Req]:
        """The requests of the decode step being built (a failure aborts them)."""
        return self.stepping

    def holders(self) -> list[Req]:
        """The requests holding KV, once each: running, or admitted with their prompt not
        done (a request may be both: `join`)."""
        return [*self.running, *(r for r in self.prefill.prefilling if not r.running)]

    def victims(self, req: Req) -> list[Req]:
        """The running requests a waiting `req` may preempt (the priority policy's): those
        of strictly lower priority, least senior first; beam requests keep their KV."""
        policy = self.prefill.policy
        out = [r for r in self.running if r.priority < req.priority and r.beam is None]
        return sorted(out, key=lambda r: seniority(r, policy))

    def preempt(self, victims: list[Req]) -> None:
        """Retract `victims` for a more urgent request: no sign that the KV estimate was
        short, so the new-token ratio stays."""
        for v in victims:
            self.retract(v, bump=False)
        self.stats["preemptions"] += len(victims)

    def _retract_youngest(self) -> None:
        """Out of KV in decode: send the least senior KV holder back to the queue (see the
        liveness argument above). The most senior is never retracted while another holds KV."""
        held = self.holders()
        policy = self.prefill.policy
        victim = min(held, key=lambda r: seniority(r, policy))
        if len(held) == 1:
            # Cannot happen (a request that fits alone gets its slots): ending it beats spinning.
            self.log.error("a lone request ran out of KV", rid=victim.rid, kv_len=victim.kv_len)
            self.finish(victim, {"type": "abort", "message": CANNOT_FIT})
            return
        self.retract(victim)

    def retract(self, victim: Req, bump: bool = True) -> None:
        """Give back the victim's KV and put it first in the queue; what it generated is
        kept and recomputed on re-admission (its in-flight results are stale: epoch).
        `bump`: raise the new-token ratio (admission reserved too little)."""
        if victim.to_abort is not None:
            self.finish(victim, {"type": "abort", "message": victim.to_abort})  # it was ending anyway
            return
        self.remove(victim)
        self.stats["retractions"] += 1
        self.kv.release(victim, cache=False)
        victim.drop_prompt_logprobs()
        if victim.pooled is not None:
            victim.pooled.reset()  # its prompt is pooled again from the start
        if victim.beam is not None:
            victim.beam.reset()  # its beams are recomputed from the prompt (likely cached) on re-admission
            victim.output_ids = []  # nothing of a beam request was sent
        victim.retractions += 1
        victim.epoch += 1
        self.prefill.requeue(victim)
        if bump:
            self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_NEW_TOKEN_RATIO_BUMP)
        self.log.info("retracted", rid=victim.rid, output_len=len(victim.output_ids), retractions=victim.retractions)

    def info(self) -> dict[str, Any]:
        # "running": every admitted request not ended, those still prefilling too (the chunked
        # one; under the overlap loop an embedding or a prefill-only request in flight, which
        # never joins the decode steps): with none running and none waiting, no request
        # holds KV.
        return {"running": len(self.running) + sum(not r.running for r in self.prefill.prefilling), **self.stats}
