"""What structured output costs: the same concurrent requests generated plain and under
a JSON schema (issue 16's measure), tokens per second each way and their ratio.

The schema asks for one long string field, so constrained outputs are long too; the
plain run ignores EOS at the same max_new_tokens. Tokens/s counts the tokens each
run generated, so shorter constrained outputs do not flatter it.

    python -m benchmarks.grammar_cost [--requests 16] [--new-tokens 64] [--model DIR] [--dtype float32]
        [--load-format dummy]   # the H200 run: the default model's config and tokenizer (.lt), random bf16 weights
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import sgl
from benchmarks.common import loop_split
from sgl.sched.models.default_model import default_model_dir

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "body": {"type": "string", "minLength": 400, "maxLength": 400}},
          "required": ["title", "body"], "additionalProperties": False}


async def run(e: sgl.AsyncEngine, prompts: list[str], params: dict[str, Any]) -> tuple[float, int]:
    t = time.perf_counter()
    outs = await asyncio.gather(*(e.generate(p, params) for p in prompts))
    return time.perf_counter() - t, sum(o["meta_info"]["completion_tokens"] for o in outs)


async def main(a: argparse.Namespace) -> None:
    prompts = [f"Write a short note number {i} about rivers, as JSON:" for i in range(a.requests)]
    plain = {"temperature": 0, "max_new_tokens": a.new_tokens, "ignore_eos": True}
    constrained = {"temperature": 0, "max_new_tokens": a.new_tokens, "json_schema": json.dumps(SCHEMA)}
    async with sgl.AsyncEngine(a.model or default_model_dir(), dtype=a.dtype, transport="ipc",
                               load_format=a.load_format) as e:
        await run(e, prompts[:2], constrained)  # warm-up: the tokenizer info and the compile, cached after
        await run(e, prompts[:2], plain)
        rows = []
        for name, params in (("plain", plain), ("json_schema", constrained)):
            await e.flush_cache()
            i0 = await e.get_server_info()
            secs, toks = await run(e, prompts, params)
            rows.append((name, secs, toks, toks / secs))
            print(f"{name}: scheduler loop {loop_split(i0, await e.get_server_info())}", flush=True)
    print(f"{'run':<12} {'seconds':>8} {'tokens':>7} {'tok/s':>8}")
    for name, secs, toks, rate in rows:
        print(f"{name:<12} {secs:8.2f} {toks:7d} {rate:8.1f}")
    print(f"json_schema / plain tok/s: {rows[1][3] / rows[0][3]:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default="auto")
    asyncio.run(main(ap.parse_args()))
