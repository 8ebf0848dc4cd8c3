"""The engine keeps its caller's event loop responsive: a ticker sleeping 5 ms in a
loop measures the worst stall while an engine starts (`await AsyncEngine.start`),
serves the issue's load, 64 concurrent prompts of ~4k tokens, and stops; and the
caller's process loads no tokenizer at all (the detokenizer's process holds it and
tokenizes). The default model's config and tokenizer with null weights: the front
end's work (tokenizing, the transport, detokenizing) is all there, the model's
arithmetic is not, so the CPU's cores are not taken by a prefill.
`SGL_LOOP_LAG_PROMPTS` and `SGL_LOOP_LAG_WORDS` change the load;
benchmarks/loop_lag.py prints the figures per phase."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import sgl
from sgl.sched.models import tokenizer as tokenizer_module
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


def test_loop_lag_under_long_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    model = default_model_dir()
    words = "the quick brown fox jumps over the lazy dog near a quiet river bank".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(WORDS)) + f" {i}" for i in range(PROMPTS)]

    def no_tokenizer_here(*args: object) -> None:
        raise AssertionError("the caller's process loaded a tokenizer")

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", no_tokenizer_here)

    async def main() -> tuple[float, list[dict[str, object]]]:
        lags: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(lags, stop))
        await asyncio.sleep(0)
        e = await sgl.AsyncEngine.start(model, load_format="null", context_length=8192)
        try:
            outs = await asyncio.gather(*(e.generate(p, {"max_new_tokens": 4, "temperature": 0},
                                                     return_logprob=True, return_text_in_logprobs=True)
                                          for p in prompts))
        finally:
            await e.aclose()
        stop.set()
        await tick
        return max(lags), outs  # type: ignore[return-value]

    worst, outs = asyncio.run(main())
    print(f"worst loop lag starting, serving {PROMPTS} x ~{WORDS}-word prompts, stopping: {worst * 1000:.1f} ms")
    assert worst < BOUND_S
    monkeypatch.undo()
    tok = tokenizer_module.load_tokenizer(model)
    for p, o in zip(prompts[:4], outs):  # the tokenizer's process encodes as the tokenizer does here
        meta = o["meta_info"]
        assert isinstance(meta, dict) and meta["prompt_tokens"] == len(tok.encode(p))
        assert [t for _, _, t in meta["output_token_logprobs"]] == [tok.decode([i]) for i in o["output_ids"]]
