"""Running one batch through the model runner for the scheduler: prepare and launch
it, complete a deferred one (its grammar masks and sampling), collect its results
and hand them to sgl.sched.results. A failure at any of these ends that batch's
requests (sgl.sched.results.fail_batch), never the loop; each batch counts once in
its requests' `inflight` from launch until it is collected or has failed.

It decides nothing about which requests run: batches come built from the scheduler."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req
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


# A batch built while a grammar batch's sampling waits for its masks is prepared before
# that sampling is queued (benchmarks/grammar_timeline.py measures both orders).
PREPARE_FIRST = True
# A grammar batch's matchers take the previous step's tokens before they are processed.
EARLY_TOKENS = True


def sample_pending(s: Scheduler, batch: ScheduleBatch | None) -> tuple[ScheduleBatch | None, PreparedBatch | None]:
    """Queue the pending batch's sampling if it waited for grammar masks (they filled
    while `batch` was built), before the next forward, which reads the tokens it
    samples; `batch` is prepared first (its host work while the masks still fill, so
    the GPU, done with that sampling, gets the next forward at once) unless that
    sampling moves request-table rows (beams). The batch (None if preparing it failed:
    its requests have ended) and what was prepared."""
    if s.pending is None or not isinstance(deferred := s.pending[1], Deferred):
        return batch, None
    prepared = None
    if batch is not None and PREPARE_FIRST and not deferred.moves_rows:
        if (prepared := prepare(s, batch)) is None:
            batch = None
    t = time.perf_counter()
    done = complete(s, s.pending[0], deferred)
    s.pending = None if done is None else (s.pending[0], done)
    s.stats["mask_wait_s"] += time.perf_counter() - t
    return batch, prepared


def complete(s: Scheduler, batch: ScheduleBatch, deferred: Deferred) -> Launched | None:
    """Queue a deferred batch's masks and sampling; None if that fails (its requests then end)."""
    try:
        return deferred.complete()
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "sampling", True)
        return None


def start(s: Scheduler, batch: ScheduleBatch, deferred: Deferred,
          just: dict[Req, int] | None = None) -> Deferred | None:
    """Start a deferred batch's masks (the previous results are in, or their tokens
    `just` sampled, about to be processed); None if that fails (its requests then end,
    as for a failed sampling)."""
    try:
        deferred.start(just)
        return deferred
    except Exception as e:  # noqa: BLE001 - contained to this batch
        _failed(s, batch, e, "sampling", True)
        return None


def collect(s: Scheduler, batch: ScheduleBatch, handle: Launched,
            early: Callable[[StepResult], None] | None = None) -> float:
    """Wait for a launched batch and process its results (or its failure); when they
    came. `early(results)` runs first, once they are on the host."""
    try:
        res = (handle.complete() if isinstance(handle, Deferred) else handle).result()
    except Exception as e:  # noqa: BLE001 - the forward failed: that batch's requests end
        _failed(s, batch, e, "forward", True)
        return time.perf_counter()
    t = time.perf_counter()
    if early is not None:
        early(res)
    process(s, batch, res)
    return t


def collect_and_start(s: Scheduler, fresh: tuple[ScheduleBatch, Deferred] | None, launched: Launched | None,
                      t: float) -> tuple[float, Launched | None]:
    """Collect the pending batch, if any (else `t` is when nothing came), and start the
    masks of `fresh`, the grammar batch just launched: with the pending batch's tokens as
    soon as they are on the host (EARLY_TOKENS: the matchers take them while they are
    processed), else once processed. When the results came, and what stands launched."""
    started: list[Launched | None] = []
    if s.pending is not None:
        prev = s.pending[0]
        early = None
        if fresh is not None and EARLY_TOKENS:
            def early(res: StepResult) -> None:
                started.append(start(s, *fresh, sampled_tokens(prev, res)))
        t = collect(s, *s.pending, early)
    if fresh is None:
        return t, launched
    return t, started[0] if started else start(s, *fresh)  # none taken early: processed, failed or no batch


def _failed(s: Scheduler, batch: ScheduleBatch, e: BaseException, stage: str, counted: bool) -> None:
    for r in batch.unique_reqs if counted else ():
        r.inflight -= 1
    fail_batch(s, batch, e, stage, kv_written=False)
