"""One launched step and its results: StepResult (the sampled ids and, when asked,
logprobs, on the device or copied to the host) and the handles `launch` returns,
whose `.result()` gives the host copy once the step is done (a Deferred one's
sampling is queued by `complete()` first).

It holds results only: it runs no forward and decides nothing about requests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from sgl.sched.req import Req
from sgl.sched.runner.beam_select import BeamPicks
from sgl.sched.runner.gpu_timeline import GpuTimeline


@dataclass(slots=True)
class StepResult:
    next_ids: torch.Tensor  # [B]
    # Per logits row [R] (request i's rows end at its sampled row); None unless asked.
    token: torch.Tensor | None = None
    top_vals: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    ids_vals: torch.Tensor | None = None
    errors: dict[int, str] | None = None  # batch row -> why its request must be aborted
    beams: list[BeamPicks] | None = None  # per beam group of the batch

    def to_host(self, non_blocking: bool) -> StepResult:
        """The same results as host tensors; pinned and not yet valid until the device
        work is done when non_blocking (the caller waits on an event)."""

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device.type == "cpu":
                return t
            if not non_blocking:
                return t.cpu()
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return StepResult(host(self.next_ids), host(self.token), host(self.top_vals), host(self.top_ids),  # type: ignore[arg-type]
                          host(self.ids_vals), self.errors,
                          None if self.beams is None else [b.to_host(non_blocking) for b in self.beams])


class Launched(Protocol):
    def result(self) -> StepResult: ...


class Deferred:
    """A step whose forward is queued but whose sampling waits: its grammar bitmasks
    need the previous step's tokens in the matchers. Once the scheduler has processed
    the previous results it calls `start()`, which fills the masks on a thread while
    the next batch is built; `complete()` (before the next forward is queued, since
    that reads this step's tokens) waits for them, queues mask and sampling and gives
    the step's real handle."""

    __slots__ = ("start", "complete", "moves_rows")

    def __init__(self, start: Callable[[dict[Req, int] | None], None], complete: Callable[[], Launched],
                 moves_rows: bool = False) -> None:
        self.start = start
        self.complete = complete
        # Its sampling moves request-table rows on the device (a beam selection): the next
        # batch, whose KV indices are gathered from that table, is prepared only after it.
        self.moves_rows = moves_rows

    def result(self) -> StepResult:
        raise RuntimeError("a deferred step's sampling was never queued: complete() it first")


class Ready:
    """A step already run to completion (CPU, no worker thread)."""

    __slots__ = ("step",)

    def __init__(self, step: StepResult) -> None:
        self.step = step

    def result(self) -> StepResult:
        return self.step


class CudaLaunched:
    """A step queued on the GPU: its results land in pinned buffers once `done` fires;
    `result` waits for that and records the step's GPU time."""

    __slots__ = ("step", "start", "done", "timeline", "decode")

    def __init__(self, step: StepResult, start: torch.cuda.Event, done: torch.cuda.Event,
                 timeline: GpuTimeline, decode: bool) -> None:
        self.step, self.start, self.done, self.timeline, self.decode = step, start, done, timeline, decode

    def result(self) -> StepResult:
        self.done.synchronize()
        self.timeline.record(self.start, self.done, self.decode)
        return self.step
