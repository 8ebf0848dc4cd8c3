"""W4 (BENCHMARKS.md): framework overhead. The null model (logits in no time), 256
concurrent requests x 256 output tokens through tokenizer manager -> scheduler ->
detokenizer over ipc. Reports tokens/s through the pipeline and the scheduler
process's CPU time per decode step at batch 256.

    python -m benchmarks.w4_pipeline_overhead [--requests 256] [--output 256] [--transport ipc]
    python -m benchmarks.w4_pipeline_overhead --tcp-security curve,hmac   # the cost of CURVE

`--tcp-security` runs the tcp transport once per mode, in the same process one after
the other: `curve` (every frame encrypted and authenticated per connection, keys made
for the engine) and `hmac` (the shared-key mode: frames signed and numbered, not
encrypted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import time

import sgl
from benchmarks.common import machine, random_prompts, table


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(model_dir: str, a: argparse.Namespace, overlap: bool, security: str = "") -> dict[str, object]:
    params = {"temperature": 0, "max_new_tokens": a.output, "ignore_eos": True}
    prompts = random_prompts(a.requests, a.input, 49152, seed=1)
    keys = {"transport_key": secrets.token_hex(32)} if security == "hmac" else {}
    async with sgl.AsyncEngine(model_dir, transport="tcp" if security else a.transport, load_format="null", **keys,
                               max_running_requests=a.requests, max_total_tokens=a.requests * (a.input + a.output) + 16,
                               disable_overlap_schedule=not overlap, disable_radix_cache=True) as e:
        await e.generate(input_ids=prompts[:4], sampling_params={**params, "max_new_tokens": 8})
        pid = next((h.pid for h in e._roles if h.name == "scheduler"), None)
        info0 = await e.get_server_info()
        cpu0 = cpu_seconds(pid) if pid else 0.0
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(e.generate(input_ids=p, sampling_params=params) for p in prompts))
        dt = time.perf_counter() - t0
        cpu1 = cpu_seconds(pid) if pid else 0.0
        info1 = await e.get_server_info()
    assert all(len(o["output_ids"]) == a.output for o in outs)
    steps = info1["decode_steps"] - info0["decode_steps"]
    return {
        **({"tcp security": security} if security else {}),
        "loop": "overlap" if overlap else "normal",
        "seconds": dt,
        "tok/s": a.requests * a.output / dt,
        "decode steps": steps,
        "sched ms/step": 1000 * (cpu1 - cpu0) / max(1, steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input", type=int, default=32)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--transport", default="ipc")
    ap.add_argument("--tcp-security", default="", help="comma list of curve, hmac: tcp once per mode")
    ap.add_argument("--model-path", default=None, help="a model folder (config and tokenizer suffice: null weights)")
    a = ap.parse_args()
    from sgl.sched.models.default_model import default_model_dir

    model_dir = a.model_path or default_model_dir()
    if a.tcp_security:
        modes = a.tcp_security.split(",")
        assert set(modes) <= {"curve", "hmac"}, modes
        rows = [asyncio.run(run(model_dir, a, overlap, m)) for m in modes for overlap in (True, False)]
        print(f"W4 on {machine()}: null model, {a.requests} x {a.output} out, tcp")
        print(table(rows))
        print("RESULT name=W4-tcp " + " ".join(f"{r['tcp security']}_{r['loop']}_tok_s={r['tok/s']:.0f}"
                                                  for r in rows))
        return
    rows = [asyncio.run(run(model_dir, a, overlap)) for overlap in (True, False)]
    print(f"W4 on {machine()}: null model, {a.requests} x {a.output} out, transport {a.transport}")
    print(table(rows))
    o = rows[0]
    print(f"RESULT name=W4 tok_s={o['tok/s']:.0f} sched_ms_per_step={o['sched ms/step']:.2f} "
          f"normal_tok_s={rows[1]['tok/s']:.0f}")


if __name__ == "__main__":
    main()
