"""Event-loop stalls caused by the engine, per phase: a ticker sleeping 5 ms in a loop
records how late each wake-up is while the engine starts (the blocking constructor,
then `await AsyncEngine.start(...)`), serves concurrent long prompts, and stops.

    python benchmarks/loop_lag.py [--prompts 16] [--words 1000] [--transport inproc] [--null]

--null: the default model's config and tokenizer with null weights (no arithmetic), so
serving measures the front end alone (tokenizing, transport, detokenizing): the target
shape is 64 x 4k-token prompts on a CPU machine (`--prompts 64 --words 3000 --null`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import sgl
from sgl.sched.models.default_model import default_model_dir

TICK_S = 0.005


Row = tuple[str, float, float, int, float]  # phase, worst ms, p99 ms, ticks, wall s


@asynccontextmanager
async def ticking(name: str, rows: list[Row]) -> AsyncIterator[None]:
    lags: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(time.perf_counter() - t - TICK_S)

    task = asyncio.create_task(tick())
    await asyncio.sleep(0)  # let it take its first reading before the phase begins
    t0 = time.perf_counter()
    try:
        yield
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        await task
        lags.sort()
        p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else wall
        worst = max(lags) if lags else wall
        rows.append((name, worst * 1000, p99 * 1000, len(lags), wall))


async def main(args: argparse.Namespace) -> None:
    model = args.model or default_model_dir()
    words = "the quick brown fox jumps over the lazy dog near a quiet river bank".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(args.words)) + f" {i}" for i in range(args.prompts)]
    kw = {"transport": args.transport, "context_length": 8192}
    if args.null:
        kw["load_format"] = "null"
    rows: list[Row] = []
    async with ticking("start: AsyncEngine(...) constructor", rows):
        e = sgl.AsyncEngine(model, **kw)
    async with ticking("stop (constructor's engine)", rows):
        await e.aclose()
    async with ticking("start: await AsyncEngine.start(...)", rows):
        e = await sgl.AsyncEngine.start(model, **kw)
    async with ticking(f"serve: {args.prompts} x {args.words}-word prompts, 4 new tokens", rows):
        await asyncio.gather(*(e.generate(p, {"max_new_tokens": 4, "temperature": 0}) for p in prompts))
    async with ticking("serve again, with logprob texts (first: the vocabulary's)", rows):
        await asyncio.gather(*(e.generate(p, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True,
                                          return_text_in_logprobs=True) for p in prompts))
    async with ticking("stop: await aclose()", rows):
        await e.aclose()
    print(f"{'phase':<58} {'worst ms':>9} {'p99 ms':>8} {'ticks':>6} {'wall s':>7}")
    for name, worst, p99, n, wall in rows:
        print(f"{name:<58} {worst:9.1f} {p99:8.1f} {n:6d} {wall:7.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--words", type=int, default=1000)
    ap.add_argument("--transport", default="inproc")
    ap.add_argument("--null", action="store_true", help="null weights: the front end alone")
    ap.add_argument("--model", help="a model directory (default: the default model); with --null only its config "
                                    "and tokenizer are read")
    asyncio.run(main(ap.parse_args()))
