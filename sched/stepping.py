"""Running one batch through the model runner for the scheduler: prepare and launch
it (prepared apart when the scheduler wants its host work done before completing the
previous batch), complete a deferred one (its grammar masks and sampling), collect its results
and hand them to sgl.sched.results. A failure at any of these ends that batch's
requests (sgl.sched.results.fail_batch), never the loop; each batch counts once in
its requests' `inflight` from launch until it is collected or has failed.

It decides nothing about which requests run: batches come built from the scheduler."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sgl.sched.batch import ScheduleBatch
from sgl.sched.results import fail_batch, process, sampled_tokens
from sgl.sched.runner.prepare import PreparedBatch
from sgl.sched.runner.step import Deferred, Launched, StepResult

if TYPE_CHECKING:
    from sgl.sched.scheduler import Scheduler


def prepare(s: Scheduler, batch: ScheduleBatch) -> PreparedBatch | None:
    """A batch's host tensors (sgl.sched.runner.prepare); None if that fails (its requests then end)."""
    try:
        return s.runner.prepare(batch)
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "prepare", False)
        return None


def launch(s: Scheduler, batch: ScheduleBatch, prepared: PreparedBatch | None = None) -> Launched | None:
    """Start a batch, prepared here unless given; None if either fails (its requests then end)."""
    if prepared is None and (prepared := prepare(s, batch)) is None:
        return None
    for r in batch.unique_reqs:
        r.inflight += 1
    try:
        launched = s.runner.launch(prepared)
        # Without overlap the previous results are in already: mask and sample now.
        return launched.complete() if isinstance(launched, Deferred) and not s.overlap else launched
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "forward", True)
        return None


def complete(s: Scheduler, batch: ScheduleBatch, deferred: Deferred) -> Launched | None:
    """Queue a deferred batch's masks and sampling; None if that fails (its requests then end)."""
    try:
        return deferred.complete()
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "sampling", True)
        return None


def start(s: Scheduler, batch: ScheduleBatch, deferred: Deferred,
          prev: tuple[ScheduleBatch, StepResult] | None = None) -> Deferred | None:
    """Start a deferred batch's masks: the previous results are processed, or `prev` are
    about to be (their tokens go to the matchers now: sgl.sched.results.sampled_tokens).
    None if that fails (its requests then end, as for a failed sampling)."""
    try:
        deferred.start(None if prev is None else sampled_tokens(*prev))
        return deferred
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "sampling", True)
        return None


def collect(s: Scheduler, batch: ScheduleBatch, handle: Launched,
            first: Callable[[ScheduleBatch, StepResult], None] | None = None) -> float:
    """Wait for a launched batch and process its results (or its failure); when they came.
    `first` sees the results before they are processed (it must not raise)."""
    try:
        res = (handle.complete() if isinstance(handle, Deferred) else handle).result()
    except Exception as e:  # noqa: BLE001 - the forward failed: that batch's requests end
        _failed(s, batch, e, "forward", True)
        return time.perf_counter()
    t = time.perf_counter()
    if first is not None:
        first(batch, res)
    process(s, batch, res)
    return t


def _failed(s: Scheduler, batch: ScheduleBatch, e: BaseException, stage: str, counted: bool) -> None:
    for r in batch.unique_reqs if counted else ():
        r.inflight -= 1
    fail_batch(s, batch, e, stage, kv_written=False)
