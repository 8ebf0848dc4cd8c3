"""Combining async streams of output chunks: `merge_streams` interleaves the chunks
of several requests (the samples of n > 1, the prompts of a streamed batch) as they
arrive; `cancel_and_close` unwinds the tasks and generators behind them.

It knows nothing of requests beyond the chunk's "index" key, sends nothing itself
(closing a request's generator is what sends its abort) and holds no state past
one call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any


async def merge_streams(gens: Sequence[AsyncIterator[dict[str, Any]]],
                        offsets: list[int] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """Interleave the chunks of several streams as they arrive. A chunk of stream i gets
    "index" = offsets[i] (i by default) plus the index it already carries (a sample's,
    when stream i is itself merged). Closing it, or an error from any stream, closes
    them all (each unfinished request sends its abort)."""
    starts = list(range(len(gens))) if offsets is None else offsets
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, g: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for chunk in g:
                await q.put((i, chunk))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    live = len(gens)
    try:
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                item["index"] = starts[i] + item.get("index", 0)
                yield item
    finally:
        await cancel_and_close(tasks, gens)


async def cancel_and_close(tasks: Sequence[asyncio.Future[Any]], gens: Sequence[Any]) -> None:
    """Cancel the tasks driving sample generators, let them unwind, then close the
    generators (one that never finished sends its abort)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for g in gens:
        await g.aclose()
