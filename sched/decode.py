"""Decode steps: which running requests take the next step, the KV slots for it,
and retraction when those slots cannot be had. The new-token ratio (the share of
their remaining max_new_tokens that running requests are expected to still need,
which prefill admission reserves) decays with each decode step and rises with
each retraction.

Liveness (why retraction can never leave the scheduler with no request making
progress). The KV holders are the running requests and the admitted ones whose
prompt is not done yet (`Scheduler.prefilling`, the chunked request among them).
The victim of a retraction is always the youngest holder by arrival
(`Scheduler.arrival`), never the oldest one H while any other holder exists:
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
- H stops being the oldest holder only by finishing or when an older request is
  re-admitted, which then has the same guarantee; arrivals are younger than every
  live request, so an older one can be re-admitted only finitely often.
So some request finishes within a bounded number of turns, whatever the traffic.
These functions work on the scheduler's state through the scheduler. They never
admit prefills and never process results."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.sched.batch import ScheduleBatch
from sgl.sched.beam import restart
from sgl.sched.req import Req

if TYPE_CHECKING:
    from sgl.sched.scheduler import Scheduler

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step
RETRACT_NEW_TOKEN_RATIO_BUMP = 0.1  # per retraction, up to 1
CANNOT_FIT = "out of KV cache memory: the request cannot fit"


def can_step(r: Req, context_length: int) -> bool:
    """Whether a running request takes part in the next decode step. Under overlap a
    request whose in-flight token will surely end it (length or context) sits out."""
    if r.to_abort is not None or (r.serial and r.inflight):
        return False
    return (len(r.output_ids) + r.inflight < r.sampling_params.max_new_tokens
            and r.seq_len + r.inflight < context_length)


def decode_batch(s: Scheduler) -> ScheduleBatch | None:
    """The next decode step of the running requests that can step, retracting the
    youngest KV holders until their slots fit; None when none can step."""
    while True:
        reqs = [r for r in s.running if can_step(r, s.runner.context_length)]
        if not reqs:
            return None
        s.building = reqs
        loc = s.alloc(sum(len(r.rows) for r in reqs))  # a beam request steps every beam
        if loc is not None:
            break
        retract_one(s)  # one holder fewer each time: the loop ends
    s.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, s.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
    s.stats["decode_steps"] += 1
    return ScheduleBatch.decode(reqs, loc, s.pool)


def holders(s: Scheduler) -> list[Req]:
    """The requests holding KV: running, or admitted with their prompt not done."""
    return [*s.running, *s.prefilling]


def retract_one(s: Scheduler) -> None:
    """Out of KV in decode: send the youngest KV holder back to the queue (see the
    liveness argument above). The oldest is never retracted while another holds KV."""
    held = holders(s)
    victim = max(held, key=lambda r: s.arrival.get(r, -1))
    if len(held) == 1:
        # Cannot happen (a request that fits alone gets its slots): ending it beats spinning.
        s.finish(victim, {"type": "abort", "message": CANNOT_FIT})
        s.log.error("a lone request ran out of KV", rid=victim.rid, kv_len=victim.kv_len)
        return
    retract(s, victim)


def retract(s: Scheduler, victim: Req) -> None:
    """Give back the victim's KV and put it first in the queue; what it generated is
    kept and recomputed on re-admission (its in-flight results are stale: epoch)."""
    if victim.to_abort is not None:
        s.finish(victim, {"type": "abort", "message": victim.to_abort})  # it was ending anyway
        return
    if victim in s.running:
        s.running.remove(victim)
    s.prefilling.discard(victim)
    if victim is s.chunked_req:
        s.chunked_req = None
    s.stats["retractions"] += 1
    s.release(victim, cache=False)
    if victim.logprobs is not None and not victim.prompt_done:
        _drop_prompt_logprobs(victim)
    if victim.beam is not None:
        restart(victim)  # its beams are recomputed from the prompt (likely cached) on re-admission
    victim.retractions += 1
    victim.epoch += 1
    s.waiting.insert(0, victim)
    s.new_token_ratio = min(1.0, s.new_token_ratio + RETRACT_NEW_TOKEN_RATIO_BUMP)
    s.log.info("retracted", rid=victim.rid, output_len=len(victim.output_ids), retractions=victim.retractions)


def _drop_prompt_logprobs(r: Req) -> None:
    """A request retracted before its prompt was done recomputes its prompt logprobs
    from the start: drop the chunks' ones gathered so far (none was sent yet), all but
    the leading None of logprob_start_len=0."""
    lp = r.logprobs
    assert lp is not None
    keep = 1 if r.logprob_start_len == 0 else 0
    for vals in (lp.input_ids, lp.input_vals, lp.input_top_vals, lp.input_top_ids, lp.input_ids_vals):
        del vals[keep:]  # an unused list is empty: nothing to drop
