"""Time to first token of urgent requests under a saturating low-priority load.

An idle engine's TTFT is the baseline. Then the engine is saturated with low-priority
requests (`--load` of them, long outputs: the running slots are all taken and a queue
waits), and `--urgent` high-priority requests arrive `--spacing` seconds apart, all
while the first wave of the load still runs; their median and
p90 TTFT are reported against the idle one, with schedule_policy fcfs (priority
ignored: an urgent request waits for a running slot like any other) and priority
(it goes first in the queue, and preempts a low-priority request when no slot is free).

    python -m benchmarks.priority_ttft                       # CPU, the null model
    python -m benchmarks.priority_ttft --device cuda         # Qwen3-0.6B, dummy weights
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

import sgl
from benchmarks.common import dummy_model_dir, table
from sgl.testing import null_model_dir


async def ttft(e: sgl.AsyncEngine, prompt: list[int], priority: int) -> float:
    """Seconds to the first streamed token of one short request."""
    t0 = time.perf_counter()
    async for _ in e.stream(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0},
                            priority=priority):
        return time.perf_counter() - t0
    raise RuntimeError("no token")


async def measure(model: str, policy: str, args: argparse.Namespace, engine_args: dict[str, Any]) -> dict[str, float]:
    e = await sgl.AsyncEngine.start(model, schedule_policy=policy, skip_tokenizer_init=True, random_seed=0,
                                    max_running_requests=args.running, **engine_args)
    try:
        prompt = list(range(1, args.prompt_len + 1))
        for _ in range(3):  # warm-up
            await ttft(e, prompt, 0)
        idle = statistics.median([await ttft(e, prompt, 0) for _ in range(args.urgent)])
        load_params = {"max_new_tokens": args.load_tokens, "ignore_eos": True, "temperature": 0}
        load = [asyncio.create_task(e.generate(input_ids=[i % 900 + 1] * args.prompt_len,
                                               sampling_params=load_params, priority=0))
                for i in range(args.load)]
        await asyncio.sleep(args.settle)  # the running slots fill, the rest queue
        busy = await e.get_server_info()

        async def urgent(k: int) -> float:
            await asyncio.sleep(k * args.spacing)
            return await ttft(e, [k % 900 + 901] * args.prompt_len, 10)

        times = list(await asyncio.gather(*(urgent(k) for k in range(args.urgent))))
        for t in load:
            t.cancel()
        await asyncio.gather(*load, return_exceptions=True)
        info = await e.get_server_info()
        times.sort()
        return {"idle_ms": idle * 1e3, "p50_ms": statistics.median(times) * 1e3,
                "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3, "preemptions": info["preemptions"],
                "waiting": busy["waiting"], "running": busy["running"]}
    finally:
        await e.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--load", type=int, default=None, help="low-priority requests (default: 3x the running slots)")
    ap.add_argument("--running", type=int, default=None, help="max_running_requests (CPU 8, GPU 64)")
    ap.add_argument("--load-tokens", type=int, default=None, help="output tokens of each (CPU 1000, GPU 2000)")
    ap.add_argument("--urgent", type=int, default=10, help="high-priority requests, --spacing s apart")
    ap.add_argument("--spacing", type=float, default=0.1)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds for the load to fill the engine")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    args.running = args.running or (64 if gpu else 8)
    args.load = args.load or 3 * args.running
    args.load_tokens = args.load_tokens or (2000 if gpu else 1000)
    if gpu:
        model, engine_args = dummy_model_dir("qwen3-0.6b"), {"load_format": "dummy", "device": "cuda"}
    else:
        model = null_model_dir(tempfile.mkdtemp(), with_tokenizer=False, context_length=8192)
        engine_args = {"load_format": "null", "device": "cpu", "max_total_tokens": 200_000}
    rows: list[dict[str, object]] = []
    for policy in ("fcfs", "priority"):
        r = asyncio.run(measure(model, policy, args, engine_args))
        rows.append({"policy": policy, "idle TTFT ms": round(r["idle_ms"], 1), "loaded p50 ms": round(r["p50_ms"], 1),
                     "loaded p90 ms": round(r["p90_ms"], 1), "p50/idle": round(r["p50_ms"] / r["idle_ms"], 1),
                     "preemptions": r["preemptions"], "load waiting/running": f"{r['waiting']}/{r['running']}"})
    print(f"{args.device}: {args.load} low-priority requests x {args.load_tokens} tokens, "
          f"max_running_requests={args.running}, {args.urgent} urgent requests (priority 10)")
    print(table(rows))

if __name__ == "__main__":
    main()
