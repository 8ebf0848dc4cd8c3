"""Schedule policies: the order in which waiting requests are considered.

fcfs keeps arrival order; lpm (longest cached prefix first) sorts by how much of
each prompt the radix cache already holds, falling back to fcfs for long queues
where matching every request each step would cost more than it saves."""

from __future__ import annotations

from typing import Any

from sgl.sched.req import Req

LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, tree: Any) -> list[Req]:
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE or len(waiting) < 2:
        return list(waiting)
    if policy == "lpm":
        # Retracted requests keep their head start whatever their prefix.
        def key(r: Req) -> tuple[int, int]:
            ids = r.all_ids
            return (r.retractions == 0, -len(tree.match_prefix(ids[: len(ids) - 1]).indices))

        return sorted(waiting, key=key)
    raise ValueError(f"schedule_policy={policy!r} is invalid: must be 'fcfs' or 'lpm'")
