"""The tokenizer manager keeps the event loop responsive: a ticker sleeping 5 ms in
a loop measures the worst stall while an inproc engine serves the issue's load, 64
concurrent prompts of ~4k tokens (long prompts are tokenized in worker threads). The
default model's config and tokenizer with null weights: the front end's work
(tokenizing, the transport, detokenizing) is all there, the model's arithmetic is
not, so the CPU's cores are not taken by a prefill. `SGL_LOOP_LAG_PROMPTS` and
`SGL_LOOP_LAG_WORDS` change the load; benchmarks/loop_lag.py prints the figures per
phase (start and stop included)."""

from __future__ import annotations

import asyncio
import os
import time

import sgl
from sgl.sched.models.default_model import default_model_dir

TICK_S = 0.005
BOUND_S = 0.2
PROMPTS = int(os.environ.get("SGL_LOOP_LAG_PROMPTS", "64"))
WORDS = int(os.environ.get("SGL_LOOP_LAG_WORDS", "3500"))


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(TICK_S)
        lags.append(time.perf_counter() - t - TICK_S)


def test_loop_lag_under_long_prompts() -> None:
    model = default_model_dir()
    words = "the quick brown fox jumps over the lazy dog near a quiet river bank".split()

    async def main() -> float:
        async with sgl.AsyncEngine(model, transport="inproc", load_format="null", context_length=8192) as e:
            prompts = [" ".join(words[(i + j) % len(words)] for j in range(WORDS)) + f" {i}" for i in range(PROMPTS)]
            lags: list[float] = []
            stop = asyncio.Event()
            tick = asyncio.create_task(ticker(lags, stop))
            outs = await asyncio.gather(*(e.generate(p, {"max_new_tokens": 4, "temperature": 0}) for p in prompts))
            stop.set()
            await tick
            assert all(o["meta_info"]["prompt_tokens"] > WORDS * 0.8 for o in outs)
            return max(lags)

    worst = asyncio.run(main())
    print(f"worst loop lag serving {PROMPTS} x ~{WORDS}-word prompts: {worst * 1000:.1f} ms")
    assert worst < BOUND_S
