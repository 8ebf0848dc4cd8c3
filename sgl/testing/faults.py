"""Faults on demand for apps' tests: the plan (sgl.core.faults, re-exported here), which
a FakeEngine obeys, and `inject_faults`, which installs one on a real engine's scheduler.

A real engine applies the plan where real failures happen (sgl.sched.faults): a refusal
at intake, the abort path, a batch's failure containment, the scheduler role's death."""

from __future__ import annotations

import asyncio
from typing import Any

from sgl.core.faults import (
    Abort,
    Always,
    Busy,
    Control,
    ControlCall,
    DataSelector,
    Die,
    Effect,
    Fail,
    FailError,
    FailStage,
    Fault,
    FaultPlan,
    FaultRequest,
    FaultSpec,
    Hang,
    Nth,
    Rid,
    Selector,
    SlowFirstToken,
    Where,
    control_misuse,
)

__all__ = [
    "Abort", "Always", "Busy", "Control", "ControlCall", "DataSelector", "Die", "Effect", "Fail", "FailError",
    "FailStage", "Fault", "FaultPlan", "FaultRequest", "FaultSpec", "Hang", "Nth", "Rid", "Selector",
    "SlowFirstToken", "Where", "control_misuse", "inject_faults",
]


async def inject_faults(engine: Any, plan: FaultPlan | None) -> None:
    """Install `plan` on `engine`, replacing the one it obeys; None removes it.

    A real engine (an `AsyncEngine`, an `sgl.Engine`, a `BackgroundEngine`) gets the
    plan's faults as data on every scheduler (each data-parallel replica and
    tensor-parallel rank), each counting its arrivals and firings from zero: `plan.fired`
    stays this process's record of a fake. ValueError for a plan the scheduler cannot
    take: a `Where` selector, or what the scheduler refuses (`SlowFirstToken` with
    tensor parallelism, whose ranks would part). A `FakeEngine` obeys `plan` itself."""
    from sgl.engine.front_end import EngineFrontEnd
    from sgl.engine.sync_engine import Engine
    from sgl.testing.engines import BackgroundEngine
    from sgl.testing.fake import FakeEngine, FakeSyncEngine

    if isinstance(engine, FakeSyncEngine):
        engine.faults = plan if plan is not None else FaultPlan()
        engine = engine._engine
    if isinstance(engine, FakeEngine):
        engine.faults = engine.scheduler.faults = plan if plan is not None else FaultPlan()
    elif isinstance(engine, BackgroundEngine):
        await engine.loop_thread.call(inject_faults(engine.engine, plan))
    elif isinstance(engine, Engine):  # its AsyncEngine runs on the Engine's own loop thread
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(inject_faults(engine._engine, plan), engine._loop))
    elif isinstance(engine, EngineFrontEnd):
        out = await engine.tm.set_faults(plan.specs() if plan is not None else None)
        if not out.success:
            raise ValueError(out.message)
    else:
        raise TypeError(f"inject_faults: {type(engine).__name__} is not an sgl engine")
