"""One launched batch (`Step`) and its results (`StepResult`: the sampled ids and, when
asked, logprobs and beam picks, on the device or copied to the host).

A step's forward is queued at launch and, for a batch without grammar rows, its
sampling too. A batch with grammar rows keeps the overlap loop through two hooks:
`fill_masks` starts filling its bitmasks on the fill thread once the previous step's
tokens are known (the forward runs meanwhile), and `sample` queues its sampling with
them, before the next forward (which reads this step's tokens). `result` waits for
the results on the host.

It runs no model code itself and decides nothing about requests."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl.core.host_copy import to_host
from sgl.sched.req import Req
from sgl.sched.runner.beam_select import BeamPicks
from sgl.sched.runner.grammar_masks import StartedFill

if TYPE_CHECKING:
    from sgl.sched.batch import ScheduleBatch
    from sgl.sched.runner.model_runner import ModelRunner
    from sgl.sched.runner.prepare import PreparedBatch


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
    pooled: torch.Tensor | None = None  # [E, H] float32: each of batch.pooled_entries' pooled row

    def to_host(self, non_blocking: bool) -> StepResult:
        """The same results as host tensors; pinned and not yet valid until the device
        work is done when non_blocking (the caller waits on an event)."""

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else to_host(t, non_blocking)

        return StepResult(host(self.next_ids), host(self.token), host(self.top_vals), host(self.top_ids),  # type: ignore[arg-type]
                          host(self.ids_vals), self.errors,
                          None if self.beams is None else [b.to_host(non_blocking) for b in self.beams],
                          host(self.pooled))


class Step:
    """One launched batch: its forward queued, its sampling queued or awaiting its
    grammar masks, its results to be read once."""

    __slots__ = ("runner", "prepared", "logits", "start", "done", "_fill", "_out")

    def __init__(self, runner: ModelRunner, prepared: PreparedBatch, logits: Future[torch.Tensor],
                 start: torch.cuda.Event | None) -> None:
        self.runner = runner
        self.prepared = prepared
        self.logits = logits  # the forward's logits rows (on CUDA done at once: the kernels are queued)
        self.start = start  # CUDA events around the step's GPU work, for the timeline
        self.done: torch.cuda.Event | None = None
        self._fill: StartedFill | None = None
        self._out: Future[StepResult] | None = None
        if prepared.grammar is None:
            self.sample()

    @property
    def batch(self) -> ScheduleBatch:
        return self.prepared.batch

    @property
    def awaits_sampling(self) -> bool:
        """A grammar batch whose sampling is not queued yet."""
        return self._out is None

    @property
    def moves_rows(self) -> bool:
        """Its sampling moves request-table rows on the device (a beam selection): a batch
        prepared before that sampling is queued would gather stale KV indices."""
        return bool(self.prepared.beams)

    def fill_masks(self, tokens: dict[Req, int] | None = None) -> None:
        """Start filling the grammar bitmasks on the fill thread; `tokens`: the previous
        step's tokens, sampled but not yet in their requests' output_ids (they are being
        processed). Nothing for a batch without grammar rows, or one started already."""
        if self._out is None and self._fill is None:
            assert self.prepared.grammar is not None
            self._fill = self.runner.sampling.masks.start(self.prepared.grammar, tokens)

    def sample(self) -> None:
        """Queue the sampling (a grammar batch's waits for its masks, filled here if they
        were never started). Nothing if queued already."""
        if self._out is not None:
            return
        fill = None
        t = time.perf_counter()
        if (g := self.prepared.grammar) is not None:
            masks = self.runner.sampling.masks
            fill = masks.finish(self._fill) if self._fill is not None else masks.fill(g)
        self._out, self.done = self.runner.queue_sampling(self.prepared, self.logits, fill)
        if fill is not None:
            self.runner.sampling.masks.times["sample_queue_s"] += time.perf_counter() - t

    def result(self) -> StepResult:
        """The step's results on the host, once the device is done with them."""
        assert self._out is not None, "a step's sampling must be queued before its results are read"
        res = self._out.result()
        if self.done is not None and self.start is not None:
            self.done.synchronize()
            self.runner.gpu_timeline.record(self.start, self.done, self.prepared.attn.is_decode)
        return res
