"""GPU busy and idle time between consecutive batches, read from CUDA event pairs.

It only adds up what the events say; it launches nothing and never synchronises
on its own (the caller has waited for each batch's end event first)."""

from __future__ import annotations

import torch


class GpuTimeline:
    """GPU busy and idle time between consecutive batches, from event pairs read once
    each batch's result is in: idle is the gap between one batch's end and the next
    one's start on the GPU, i.e. time the GPU waited for the host. The gaps between
    two decode steps are also summed apart (`decode_idle_s`, against `decode_busy_s`):
    that is where the overlap loop must keep the GPU fed."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.decode_busy_s = 0.0
        self.decode_idle_s = 0.0
        self._prev: tuple[torch.cuda.Event, bool] | None = None  # the last batch's end, and was it decode

    def record(self, start: torch.cuda.Event, done: torch.cuda.Event, decode: bool) -> None:
        """Both events have completed (the caller synchronised on `done`)."""
        busy = start.elapsed_time(done) / 1000
        self.busy_s += busy
        if decode:
            self.decode_busy_s += busy
        if self._prev is not None:
            gap = max(0.0, self._prev[0].elapsed_time(start) / 1000)
            self.idle_s += gap
            if decode and self._prev[1]:
                self.decode_idle_s += gap
        self._prev = (done, decode)

    def info(self) -> dict[str, float]:
        return {"gpu_busy_s": self.busy_s, "gpu_idle_s": self.idle_s, "gpu_decode_busy_s": self.decode_busy_s,
                "gpu_decode_idle_s": self.decode_idle_s}

    def reset_gap(self) -> None:
        """The scheduler went idle on purpose: the next gap is not the host's lateness."""
        self._prev = None
