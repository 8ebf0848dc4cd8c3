"""Faults on demand on a real engine (sgl.testing.inject_faults): every effect and
selector of a FaultPlan on the null model, seen through the public API (exceptions,
finish reasons, timeouts), the KV balanced after each (but a death) and the engine
serving on; the same plan giving a FakeEngine and a real engine the same outcomes; all
data-parallel replicas taking a plan; and a plan sent to a scheduler process (ipc)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import sgl
from sgl.core.faults import FaultSpec
from sgl.sched.faults import FaultInjector
from sgl.testing import BackgroundEngine, FakeEngine, inject_faults, server_info_when_idle
from sgl.testing.faults import (
    Abort,
    Always,
    Busy,
    Control,
    Die,
    Fail,
    Fault,
    FaultPlan,
    Hang,
    Nth,
    Rid,
    SlowFirstToken,
    Where,
)
from tests.conftest import assert_kv_balanced, null_continuation

PROMPT = [1, 2, 3]
SP = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
WANT = null_continuation(PROMPT[-1], 6)
ENGINE_ARGS: dict[str, Any] = {"load_format": "null", "skip_tokenizer_init": True, "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def shared(null_model_dir: str) -> Iterator[BackgroundEngine]:
    with BackgroundEngine.start(null_model_dir, transport="inproc", health_timeout=0.3, **ENGINE_ARGS) as e:
        yield e


@pytest.fixture
def real(shared: BackgroundEngine) -> Iterator[BackgroundEngine]:
    """The shared engine; after the test its plan is removed and its KV balances."""
    yield shared
    asyncio.run(inject_faults(shared, None))
    assert_kv_balanced(shared.idle_server_info())


async def generate(engine: Any, rid: str | None = None, **params: Any) -> dict[str, Any]:
    out: dict[str, Any] = await engine.generate(input_ids=PROMPT, sampling_params={**SP, **params}, rid=rid)
    return out


async def chunks(stream: AsyncIterator[dict[str, Any]], into: list[dict[str, Any]]) -> None:
    async for c in stream:
        into.append(c)


# ---- each effect, each selector --------------------------------------------------------


def test_busy_is_refused_as_a_full_queue_refuses(real: BackgroundEngine) -> None:
    async def main() -> list[str]:
        plan = FaultPlan()
        plan.add(Busy(), Nth(2, every=True))
        await inject_faults(real, plan)
        seen = []
        for _ in range(4):
            try:
                out = await generate(real)
                seen.append("ok" if out["output_ids"] == WANT else repr(out))
            except sgl.ServerBusyError as e:
                assert str(e).startswith("server busy: ") and str(e).endswith("retry later")
                seen.append("busy")
        return seen

    assert asyncio.run(main()) == ["ok", "busy", "ok", "busy"]


def test_abort_ends_the_request_through_the_abort_path(real: BackgroundEngine) -> None:
    async def main() -> None:
        plan = FaultPlan()
        plan.add(Abort(after_tokens=2, message="stopped by the plan"), Rid("a"))
        await inject_faults(real, plan)
        got: list[dict[str, Any]] = []
        other = asyncio.ensure_future(generate(real, rid="b"))
        await chunks(real.stream(input_ids=PROMPT, sampling_params=SP, rid="a"), got)
        # Two tokens, then the abort (chunks a slow reader missed come joined: any chunking).
        assert [t for c in got for t in c["output_ids"]] == WANT[:2]
        assert got[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "stopped by the plan"}
        assert all(c["meta_info"]["finish_reason"] is None for c in got[:-1])
        assert (await other)["output_ids"] == WANT  # another rid: untouched
        assert (await generate(real, rid="a"))["meta_info"]["finish_reason"]["type"] == "abort"

    asyncio.run(main())


@pytest.mark.parametrize("stage", ["prepare", "forward", "result processing"])
def test_fail_ends_the_batch_in_its_stage_and_the_engine_serves_on(real: BackgroundEngine, stage: Any) -> None:
    async def main() -> None:
        before = (await real.get_server_info())["failures"]
        plan = FaultPlan()
        plan.add(Fail(after_tokens=2, stage=stage, message="boom"), Always(), times=1)
        await inject_faults(real, plan)
        out = await generate(real)
        assert out["meta_info"]["finish_reason"] == {"type": "abort",
                                                     "message": f"internal error in {stage} (RuntimeError): boom"}
        assert out["output_ids"] == WANT[:2]
        assert (await generate(real))["output_ids"] == WANT  # once
        assert (await real.get_server_info())["failures"] == before + 1

    asyncio.run(main())


def test_an_out_of_memory_failure_retracts_once_then_aborts(real: BackgroundEngine) -> None:
    async def main() -> None:
        oom = Fail(after_tokens=1, error="OutOfMemoryError", message="injected: CUDA out of memory")
        plan = FaultPlan()
        plan.add(oom, Rid("once"))
        plan.add(oom, Rid("twice"))
        plan.add(oom, Rid("twice"))
        await inject_faults(real, plan)
        before = (await real.get_server_info())["retractions"]
        assert (await generate(real, rid="once"))["output_ids"] == WANT  # retracted, recomputed, done
        assert (await real.get_server_info())["retractions"] == before + 1
        out = await generate(real, rid="twice")
        assert out["meta_info"]["finish_reason"]["message"] == \
            "internal error in forward (OutOfMemoryError): injected: CUDA out of memory"

    asyncio.run(main())


def test_hang_meets_the_callers_timeout_and_its_abort(real: BackgroundEngine) -> None:
    async def main() -> None:
        plan = FaultPlan()
        plan.add(Hang(after_tokens=2), Rid("mid"))
        plan.add(Hang(), Rid("first"))
        plan.add(Hang(), Control("health"))
        await inject_faults(real, plan)
        got: list[dict[str, Any]] = []
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(chunks(real.stream(input_ids=PROMPT, sampling_params=SP, rid="mid"), got), 0.5)
        assert [t for c in got for t in c["output_ids"]] == WANT[:2]  # in one chunk or two
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(generate(real, rid="first"), 0.3)
        with pytest.raises(TimeoutError, match="HealthCheckReq"):
            await real.health()
        assert (await generate(real))["output_ids"] == WANT

    asyncio.run(main())
    info = real.idle_server_info()  # the aborts freed what the hung requests held
    assert info["running"] == 0 and info["kv_protected"] == 0


def test_a_slow_first_token_holds_the_request_back_not_the_others(real: BackgroundEngine) -> None:
    async def main() -> None:
        plan = FaultPlan()
        plan.add(SlowFirstToken(60.0), Rid("given-up"))
        plan.add(SlowFirstToken(0.5), Rid("slow"))
        await inject_faults(real, plan)
        with pytest.raises(asyncio.TimeoutError):  # held back; its caller's abort releases it
            await asyncio.wait_for(generate(real, rid="given-up"), 0.2)
        t0 = time.monotonic()
        slow = asyncio.ensure_future(generate(real, rid="slow"))
        await asyncio.sleep(0.05)  # it arrives first
        assert (await generate(real))["output_ids"] == WANT
        assert not slow.done()
        assert (await slow)["output_ids"] == WANT
        assert time.monotonic() - t0 >= 0.5

    asyncio.run(main())


def test_a_removed_plan_plants_nothing(real: BackgroundEngine) -> None:
    async def main() -> None:
        plan = FaultPlan()
        plan.add(Busy())
        await inject_faults(real, plan)
        with pytest.raises(sgl.ServerBusyError):
            await generate(real)
        await inject_faults(real, None)
        assert (await generate(real))["output_ids"] == WANT

    asyncio.run(main())


def test_plans_a_real_engine_cannot_take_are_refused(real: BackgroundEngine) -> None:
    async def main() -> None:
        where = FaultPlan()
        where.add(Busy(), Where(lambda r: True))
        with pytest.raises(ValueError, match="encoded message on every transport"):
            await inject_faults(real, where)
        with pytest.raises(ValueError, match="stage"):
            await inject_faults(real, FaultPlan(Fault(Fail(stage="sampling"), Always())))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="a control call can only die or hang"):  # the scheduler's refusal
            await inject_faults(real, FaultPlan(Fault(Busy(), Control("health"))))
        assert (await generate(real))["output_ids"] == WANT

    asyncio.run(main())
    tp = FaultInjector(None, None, None, None, None, tp_size=2)  # type: ignore[arg-type]
    assert "tensor parallelism" in (tp.install([FaultSpec(SlowFirstToken(1.0), Always())]) or "")


def test_under_the_overlap_loop_the_outputs_stop_where_planted(null_model_dir: str) -> None:
    """A batch launched before the last one's tokens are in: the planted point holds all the same."""
    async def main() -> None:
        async with await sgl.AsyncEngine.start(null_model_dir, transport="inproc", disable_overlap_schedule=False,
                                               **ENGINE_ARGS) as e:
            plan = FaultPlan()
            plan.add(Abort(after_tokens=3), Rid("abort"))
            plan.add(Fail(after_tokens=3), Rid("forward"))
            plan.add(Fail(after_tokens=3, stage="result processing"), Rid("late"))
            plan.add(Hang(after_tokens=3), Rid("hang"))
            await inject_faults(e, plan)
            for rid in ("abort", "forward", "late"):
                out = await generate(e, rid=rid)
                assert out["output_ids"] == WANT[:3] and out["meta_info"]["finish_reason"]["type"] == "abort", out
            got: list[dict[str, Any]] = []
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(chunks(e.stream(input_ids=PROMPT, sampling_params=SP, rid="hang"), got), 0.5)
            assert [t for c in got for t in c["output_ids"]] == WANT[:3]
            assert (await generate(e))["output_ids"] == WANT
            assert_kv_balanced(await server_info_when_idle(e))

    asyncio.run(main())


# ---- the same plan on a fake and a real engine --------------------------------------------


async def outcomes(engine: Any, plan: FaultPlan) -> list[Any]:
    await inject_faults(engine, plan)
    seen: list[Any] = []
    for rid in ("calm", "busy", "abort", "fail"):
        try:
            out = await generate(engine, rid=rid)
            seen.append((out["output_ids"], out["meta_info"]["finish_reason"]))
        except sgl.ServerBusyError:
            seen.append("busy")
    return seen


def test_a_plan_gives_a_fake_and_a_real_engine_the_same_outcomes(real: BackgroundEngine) -> None:
    plan = FaultPlan()
    plan.add(Busy(), Rid("busy"))
    plan.add(Abort(after_tokens=2), Rid("abort"))
    plan.add(Fail(after_tokens=3), Rid("fail"))

    async def on_fake() -> list[Any]:
        async with FakeEngine([WANT], skip_tokenizer_init=True) as fake:
            return await outcomes(fake, plan)

    fake, real_ones = asyncio.run(on_fake()), asyncio.run(outcomes(real, plan))
    assert fake == real_ones == [
        (WANT, {"type": "length", "length": 6}), "busy",
        (WANT[:2], {"type": "abort", "message": "aborted by the client"}),
        (WANT[:3], {"type": "abort", "message": "internal error in forward (RuntimeError): a planted fault"}),
    ]


# ---- replicas, deaths, a scheduler process --------------------------------------------------


def test_every_data_parallel_replica_takes_the_plan(null_model_dir: str) -> None:
    async def main() -> None:
        async with await sgl.AsyncEngine.start(null_model_dir, transport="inproc", dp_size=2, **ENGINE_ARGS) as e:
            plan = FaultPlan()
            plan.add(Busy(), Nth(1))  # each replica's first arrival
            await inject_faults(e, plan)
            # Sent together, they go to the least busy replica in turn: 0, 1, 0, 1.
            outs = await asyncio.gather(*(e.generate(input_ids=[i + 1], sampling_params=SP) for i in range(4)),
                                        return_exceptions=True)
            assert [isinstance(o, sgl.ServerBusyError) for o in outs] == [True, True, False, False]
            info = await e.get_server_info()
            assert [r["routed"] for r in info["replicas"]] == [2, 2]
            assert_kv_balanced(info)

    asyncio.run(main())


def test_die_mid_stream_fails_every_pending_and_later_call(null_model_dir: str) -> None:
    async def main() -> None:
        async with await sgl.AsyncEngine.start(null_model_dir, transport="inproc", watchdog_interval=0.05,
                                               **ENGINE_ARGS) as e:
            plan = FaultPlan()
            plan.add(Die(after_tokens=3), Rid("killer"))
            await inject_faults(e, plan)
            pending = e.stream(input_ids=[7], sampling_params={**SP, "max_new_tokens": 400})
            await pending.__anext__()
            got: list[dict[str, Any]] = []
            with pytest.raises(sgl.EngineDeadError, match="planted fault after 3 tokens of request 'killer'"):
                await chunks(e.stream(input_ids=PROMPT, sampling_params=SP, rid="killer"), got)
            ids = [t for c in got for t in c["output_ids"]]
            assert ids == WANT[: len(ids)] and len(ids) <= 3
            with pytest.raises(sgl.EngineDeadError):
                await chunks(pending, [])
            with pytest.raises(sgl.EngineDeadError):
                await generate(e)
            assert "PlantedDeath" in (e.dead_reason() or "")

    asyncio.run(main())


def test_a_plan_reaches_a_scheduler_process_and_dies_at_a_control_call(null_model_dir: str) -> None:
    async def main() -> None:
        async with await sgl.AsyncEngine.start(null_model_dir, transport="ipc", watchdog_interval=0.05,
                                               **ENGINE_ARGS) as e:
            plan = FaultPlan()
            plan.add(Abort(after_tokens=1, message="over ipc"), Nth(1))
            plan.add(Fail(after_tokens=2, stage="prepare"), Rid("fail"))
            plan.add(Die(), Control("flush_cache"))
            await inject_faults(e, plan)
            first = await generate(e)
            assert (first["output_ids"], first["meta_info"]["finish_reason"]) == \
                (WANT[:1], {"type": "abort", "message": "over ipc"})
            assert (await generate(e, rid="fail"))["meta_info"]["finish_reason"]["message"] == \
                "internal error in prepare (RuntimeError): a planted fault"
            assert (await generate(e))["output_ids"] == WANT
            assert_kv_balanced(await e.get_server_info())
            with pytest.raises(sgl.EngineDeadError):
                await e.flush_cache()
            with pytest.raises(sgl.EngineDeadError):
                await generate(e)

    asyncio.run(main())


def test_a_fakes_scheduler_takes_a_plan_sent_as_data_too() -> None:
    async def main() -> None:
        async with FakeEngine([WANT], skip_tokenizer_init=True) as fake:
            plan = FaultPlan()
            plan.add(Busy())
            assert (await fake.tm.set_faults(plan.specs())).success
            with pytest.raises(sgl.ServerBusyError):
                await generate(fake)
            assert (await fake.tm.set_faults(None)).success
            assert (await generate(fake))["output_ids"] == WANT

    asyncio.run(main())
