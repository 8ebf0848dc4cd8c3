"""Decode steps: which running requests take the next step, the KV slots for it,
and retraction when those slots cannot be had. The new-token ratio (the share of
their remaining max_new_tokens that running requests are expected to still need,
which prefill admission reserves) decays with each decode step and rises with
each retraction.

These functions work on the scheduler's state through the scheduler. They never
admit prefills and never process results."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req

if TYPE_CHECKING:
    from sgl.sched.scheduler import Scheduler

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step
RETRACT_NEW_TOKEN_RATIO_BUMP = 0.1  # per retraction, up to 1


def can_step(r: Req, context_length: int) -> bool:
    """Whether a running request takes part in the next decode step. Under overlap a
    request whose in-flight token will surely end it (length or context) sits out."""
    if r.to_abort is not None:
        return False
    return (len(r.output_ids) + r.inflight < r.sampling_params.max_new_tokens
            and r.seq_len + r.inflight < context_length)


def decode_batch(s: Scheduler) -> ScheduleBatch | None:
    """The next decode step of the running requests that can step, retracting
    requests until their slots fit; None when none can step."""
    while True:
        reqs = [r for r in s.running if can_step(r, s.runner.context_length)]
        if not reqs:
            return None
        loc = s.alloc(len(reqs))
        if loc is not None:
            break
        retract_one(s)
    s.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, s.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
    s.stats["decode_steps"] += 1
    return ScheduleBatch.decode(reqs, loc, s.pool)


def retract_one(s: Scheduler) -> None:
    """Out of KV in decode: send the request with the least progress back to the queue."""
    victim = min(s.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
    s.running.remove(victim)
    s.stats["retractions"] += 1
    if not s.running and not s.waiting:
        # Alone and still out of memory: it can never finish.
        s.finish(victim, {"type": "abort", "message": "out of KV cache memory: the request cannot fit"})
        return
    s.release(victim, cache=False)
    victim.retractions += 1
    victim.epoch += 1
    s.waiting.insert(0, victim)
    s.new_token_ratio = min(1.0, s.new_token_ratio + RETRACT_NEW_TOKEN_RATIO_BUMP)
    s.log.info("retracted", rid=victim.rid, output_len=len(victim.output_ids))
