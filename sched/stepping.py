"""Running one batch through the model runner for the scheduler: prepare and launch
it, complete a deferred one (its grammar masks and sampling), collect its results
and hand them to sgl.sched.results. A failure at any of these ends that batch's
requests (sgl.sched.results.fail_batch), never the loop; each batch counts once in
its requests' `inflight` from launch until it is collected or has failed.

It decides nothing about which requests run: batches come built from the scheduler."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sgl.sched.batch import ScheduleBatch
from sgl.sched.results import fail_batch, process
from sgl.sched.runner.step import Deferred, Launched

if TYPE_CHECKING:
    from sgl.sched.scheduler import Scheduler


def launch(s: Scheduler, batch: ScheduleBatch) -> Launched | None:
    """Prepare and start a batch; None if either fails (its requests then end)."""
    counted = False
    try:
        prepared = s.runner.prepare(batch)
        for r in batch.unique_reqs:
            r.inflight += 1
        counted = True
        launched = s.runner.launch(prepared)
        # Without overlap the previous results are in already: mask and sample now.
        return launched.complete() if isinstance(launched, Deferred) and not s.overlap else launched
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "forward" if counted else "prepare", counted)
        return None


def complete(s: Scheduler, batch: ScheduleBatch, deferred: Deferred) -> Launched | None:
    """Queue a deferred batch's masks and sampling; None if that fails (its requests then end)."""
    try:
        return deferred.complete()
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "sampling", True)
        return None


def start(s: Scheduler, batch: ScheduleBatch, deferred: Deferred) -> Deferred | None:
    """Start a deferred batch's masks (the previous results are in); None if that fails
    (its requests then end, as for a failed sampling)."""
    try:
        deferred.start()
        return deferred
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "sampling", True)
        return None


def collect(s: Scheduler, batch: ScheduleBatch, handle: Launched) -> float:
    """Wait for a launched batch and process its results (or its failure); when they came."""
    try:
        res = (handle.complete() if isinstance(handle, Deferred) else handle).result()
    except Exception as e:  # noqa: BLE001 - the forward failed: that batch's requests end
        _failed(s, batch, e, "forward", True)
        return time.perf_counter()
    t = time.perf_counter()
    process(s, batch, res)
    return t


def _failed(s: Scheduler, batch: ScheduleBatch, e: BaseException, stage: str, counted: bool) -> None:
    for r in batch.unique_reqs if counted else ():
        r.inflight -= 1
    fail_batch(s, batch, e, stage, kv_written=False)
