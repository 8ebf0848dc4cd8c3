"""Fan-out over several async streams of output chunks, on anyio task groups:
`merge_streams` interleaves the chunks of several requests (the samples of n > 1,
the prompts of a streamed batch) as they arrive; `gather_first` awaits the first
(for a non-streamed request, the only) item of each, `gather_calls` the result of
each call (the prompts of a batch). A failure or cancellation of
one part cancels its siblings, and every generator is closed before either returns
(closing an unfinished request's generator is what sends its abort).

It knows nothing of requests beyond the chunk's "index" key, sends nothing itself
and holds no state past one call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
from anyio.abc import ObjectSendStream, TaskGroup


async def merge_streams(gens: Sequence[AsyncIterator[dict[str, Any]]],
                        offsets: list[int] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """Interleave the chunks of several streams as they arrive. A chunk of stream i gets
    "index" = offsets[i] (i by default) plus the index it already carries (a sample's,
    when stream i is itself merged). Closing it, or an error from any stream, closes
    them all (each unfinished request sends its abort); the error is raised as is.

    The task group lives in a driver task, not across this generator's yields, so the
    generator may be closed from any task (a caller's `break`, a finalizer)."""
    starts = list(range(len(gens))) if offsets is None else offsets
    errors: list[BaseException] = []
    send, recv = anyio.create_memory_object_stream[tuple[int, dict[str, Any]]](len(gens))

    async def pump(i: int, g: AsyncIterator[dict[str, Any]], out: ObjectSendStream[tuple[int, dict[str, Any]]],
                   tg: TaskGroup) -> None:
        async with out:
            try:
                async for chunk in g:
                    await out.send((i, chunk))
            except Exception as e:  # noqa: BLE001 - raised by the consumer, after the siblings stop
                errors.append(e)
                tg.cancel_scope.cancel()
            finally:
                await _close(g)

    async def drive() -> None:
        async with send, anyio.create_task_group() as tg:
            for i, g in enumerate(gens):
                tg.start_soon(pump, i, g, send.clone(), tg)

    driver = asyncio.ensure_future(drive())
    try:
        async with recv:
            async for i, item in recv:
                item["index"] = starts[i] + item.get("index", 0)
                yield item
    finally:
        driver.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(driver, return_exceptions=True)
    if errors:
        raise errors[0]


async def gather_first(gens: Sequence[AsyncIterator[Any]]) -> list[Any]:
    """The first item of each generator, awaited concurrently. The first error cancels
    the others and is raised as is; the generators are left for the caller to close."""
    return await gather_calls([g.__anext__ for g in gens])


async def gather_calls(calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Each call's result, awaited concurrently in one task group: the first error
    cancels the others and is raised as is (not wrapped in an exception group), and
    cancelling the caller cancels them all."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    async def one(i: int, call: Callable[[], Awaitable[Any]]) -> None:
        try:
            results[i] = await call()
        except Exception as e:  # noqa: BLE001 - raised below, after the siblings stop
            errors.append(e)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(one, i, call)
    if errors:
        raise errors[0]
    return results


async def close_all(gens: Sequence[Any]) -> None:
    """Close every generator, even from a cancelled task (one that never finished sends
    its abort)."""
    for g in gens:
        await _close(g)


async def _close(g: Any) -> None:
    with anyio.CancelScope(shield=True):
        await g.aclose()
