"""Cancellation is the API: cancelling the task awaiting `generate` (asyncio.timeout,
anyio.move_on_after) or leaving `stream` early aborts the request in the scheduler
and frees its KV; and the fan-out helpers cancel and close the siblings of a part
that fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import anyio
import pytest

import sgl
from sgl.runtime.streams import gather_first, merge_streams
from tests.conftest import assert_kv_balanced

# Far more work than any machine does in the tests' windows: each case also waits
# until the scheduler holds the request before cancelling, so none can finish first.
LONG = {"temperature": 0.0, "max_new_tokens": 20_000, "ignore_eos": True}
CONTEXT = 20_100


async def running(e: sgl.AsyncEngine, n: int) -> None:
    """Until the scheduler runs `n` requests (the one under test has really started)."""
    for _ in range(500):
        if (await e.get_server_info())["running"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never ran")


async def settled(e: sgl.AsyncEngine) -> dict[str, Any]:
    for _ in range(200):
        info = await e.get_server_info()
        if info["running"] == 0 and info["waiting"] == 0:
            return info
        await asyncio.sleep(0.02)
    return info


def run_engine(null_model_dir: str, body: Any) -> None:
    async def main() -> None:
        async with sgl.AsyncEngine(null_model_dir, transport="inproc", load_format="null", skip_tokenizer_init=True,
                                   context_length=CONTEXT, max_total_tokens=3 * CONTEXT,
                                   max_running_requests=16) as e:
            await body(e)
            assert_kv_balanced(await settled(e))

    asyncio.run(main())


def test_timeout_cancels_generate(null_model_dir: str) -> None:
    async def body(e: sgl.AsyncEngine) -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await e.generate(input_ids=[4, 5], sampling_params=LONG)
        async with anyio.create_task_group() as tg:  # n > 1: every sample aborted
            scope = anyio.CancelScope()

            async def generate() -> None:
                with scope:
                    await e.generate(input_ids=[4, 5], sampling_params={**LONG, "n": 3})

            tg.start_soon(generate)
            await running(e, 3)
            scope.cancel()
        assert scope.cancelled_caught
        assert e.tm.states == {}

    run_engine(null_model_dir, body)


def test_leaving_stream_aborts(null_model_dir: str) -> None:
    async def body(e: sgl.AsyncEngine) -> None:
        async for _chunk in e.stream(input_ids=[4, 5], sampling_params=LONG):
            break  # the generator is finalized (closed) once dropped
        stream = e.stream(input_ids=[[4], [5, 6]], sampling_params={**LONG, "n": 2})
        async for _chunk in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)
        assert e.tm.states == {}

    run_engine(null_model_dir, body)


async def _gen(name: str, log: list[str], items: int, fail: bool = False) -> AsyncGenerator[dict[str, Any], None]:
    try:
        for i in range(items):
            await asyncio.sleep(0.01)
            yield {"n": i}
        if fail:
            raise ValueError(name)
        await asyncio.sleep(10)
        yield {"n": -1}
    finally:
        log.append(name)


@pytest.mark.anyio
async def test_merge_streams_failure_closes_siblings() -> None:
    log: list[str] = []
    got: list[dict[str, Any]] = []
    with pytest.raises(ValueError, match="bad"):
        async for chunk in merge_streams([_gen("a", log, 1), _gen("bad", log, 2, fail=True), _gen("c", log, 1)]):
            got.append(chunk)
    assert sorted(log) == ["a", "bad", "c"] and len(got) == 4


@pytest.mark.anyio
async def test_gather_first_failure_cancels_siblings() -> None:
    log: list[str] = []
    gens = [_gen("a", log, 0), _gen("bad", log, 0, fail=True)]
    with pytest.raises(ValueError, match="bad"):
        await gather_first(gens)
    for g in gens:
        await g.aclose()
    assert sorted(log) == ["a", "bad"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_cancelling_a_batch_aborts_every_prompt(null_model_dir: str) -> None:
    async def body(e: sgl.AsyncEngine) -> None:
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def generate() -> None:
                with scope:
                    await e.generate(input_ids=[[4, 5], [6], [7, 8, 9]], sampling_params=LONG)

            tg.start_soon(generate)
            await running(e, 3)
            scope.cancel()
        assert scope.cancelled_caught
        assert e.tm.states == {}
        # A prompt that fails cancels its siblings: the bad one is refused, none is left running.
        with pytest.raises(ValueError, match="input_ids"):
            await e.generate(input_ids=[[4, 5], [], [7]], sampling_params=LONG)
        assert e.tm.states == {}

    run_engine(null_model_dir, body)
