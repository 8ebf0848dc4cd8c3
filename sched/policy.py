"""Schedule policies: the order in which waiting requests are considered, and which
KV holder gives way first.

fcfs keeps arrival order; lpm (longest cached prefix first) sorts by how much of
each prompt the radix cache already holds, falling back to fcfs for long queues
where matching every request each step would cost more than it saves; priority
considers higher `Req.priority` first and arrival order within one priority (the
PrefillManager keeps its queue in that order as requests join, so nothing is sorted
per round). Under the other policies a request's priority is ignored.

`seniority` ranks KV holders: the least senior is retracted first when a decode step
lacks KV, and is the first victim of a priority preemption (sgl.sched.decode)."""

from __future__ import annotations

from typing import Any

from sgl.sched.req import Req

LPM_MAX_QUEUE = 128
POLICIES = ("fcfs", "lpm", "priority")


def order_waiting(waiting: list[Req], policy: str, tree: Any) -> list[Req]:
    if policy in ("fcfs", "priority") or len(waiting) > LPM_MAX_QUEUE or len(waiting) < 2:
        return list(waiting)
    if policy == "lpm":
        # Retracted requests keep their head start whatever their prefix.
        def key(r: Req) -> tuple[int, int]:
            ids = r.all_ids
            return (r.retractions == 0, -len(tree.match_prefix(ids[: len(ids) - 1], r.cache_namespace).indices))

        return sorted(waiting, key=key)
    raise ValueError(f"schedule_policy={policy!r} is invalid: must be one of {POLICIES}")


def queue_key(req: Req) -> int:
    """The priority policy's queue order: ascending key is descending priority."""
    return -req.priority


def seniority(req: Req, policy: str) -> tuple[int, int]:
    """A KV holder's rank (larger is more senior): its priority under the priority
    policy, then age (an earlier arrival is more senior)."""
    return (req.priority if policy == "priority" else 0, -req.arrival)
