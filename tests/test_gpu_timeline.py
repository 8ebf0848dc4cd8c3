"""The scheduler's GPU timeline (sgl.sched.runner.gpu_timeline.GpuTimeline), on fake events: busy
time per batch, idle gaps between batches, and the gaps between two decode steps
summed apart, which is what the overlap loop's idle target is measured by."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sgl.sched.runner.gpu_timeline import GpuTimeline


@dataclass(frozen=True)
class FakeEvent:
    t_ms: float

    def elapsed_time(self, later: FakeEvent) -> float:
        return later.t_ms - self.t_ms


def test_decode_gaps_are_summed_apart() -> None:
    tl = GpuTimeline()
    # (start ms, end ms, decode?): a prefill, two decodes, a prefill, a decode, a decode.
    batches = [(0, 10, False), (12, 15, True), (16, 19, True), (25, 35, False), (40, 43, True), (43.5, 46, True)]
    for start, end, decode in batches:
        tl.record(FakeEvent(start), FakeEvent(end), decode)  # type: ignore[arg-type]
    assert tl.busy_s == pytest.approx((10 + 3 + 3 + 10 + 3 + 2.5) / 1000)
    assert tl.idle_s == pytest.approx((2 + 1 + 6 + 5 + 0.5) / 1000)
    assert tl.decode_busy_s == pytest.approx((3 + 3 + 3 + 2.5) / 1000)
    # Only decode -> decode gaps: 15 -> 16 and 43 -> 43.5.
    assert tl.decode_idle_s == pytest.approx((1 + 0.5) / 1000)


def test_reset_gap_drops_the_next_gap() -> None:
    tl = GpuTimeline()
    tl.record(FakeEvent(0), FakeEvent(1), True)  # type: ignore[arg-type]
    tl.reset_gap()  # the scheduler went idle on purpose
    tl.record(FakeEvent(100), FakeEvent(101), True)  # type: ignore[arg-type]
    tl.record(FakeEvent(103), FakeEvent(104), True)  # type: ignore[arg-type]
    assert tl.idle_s == pytest.approx(0.002) and tl.decode_idle_s == pytest.approx(0.002)
