"""W4 (BENCHMARKS.md): framework overhead. The null model (logits in no time), 256
concurrent requests x 256 output tokens through tokenizer manager -> scheduler ->
detokenizer over ipc. Reports tokens/s through the pipeline and the scheduler
process's CPU time per decode step at batch 256.

    python -m benchmarks.w4_pipeline_overhead [--requests 256] [--output 256] [--transport ipc] [--temperature 0]
    python -m benchmarks.w4_pipeline_overhead --tcp-security curve,hmac [--repeat 3]   # the cost of CURVE
    python -m benchmarks.w4_pipeline_overhead --frame-cost                            # per frame, no engine

`--tcp-security` runs the tcp transport once per mode (`--repeat` rounds, modes
interleaved, then the best of each), in the same process one after the other: `curve`
(every frame encrypted and authenticated per connection, keys made for the engine)
and `hmac` (the shared-key mode: frames signed and numbered, not encrypted).
`--frame-cost` sends W4-sized frames (a BatchStrOutput of --requests rows) through
one tcp channel per mode, plain included, and reports the process's CPU time per
frame (encoding, ZMQ's I/O threads with their encryption, decoding): CPU time, so
other load on the machine disturbs it less than it does the tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import time

import sgl
from benchmarks.common import machine, random_prompts, table
from sgl.core.protocol import BatchStrOutput


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(model_dir: str, a: argparse.Namespace, overlap: bool, security: str = "") -> dict[str, object]:
    params = {"temperature": a.temperature, "max_new_tokens": a.output, "ignore_eos": True}
    prompts = random_prompts(a.requests, a.input, 49152, seed=1)
    keys = {"transport_key": secrets.token_hex(32)} if security == "hmac" else {}
    async with sgl.AsyncEngine(model_dir, transport="tcp" if security else a.transport, load_format="null", **keys,
                               max_running_requests=a.requests, max_total_tokens=a.requests * (a.input + a.output) + 16,
                               disable_overlap_schedule=not overlap, disable_radix_cache=True) as e:
        await e.generate(input_ids=prompts[:4], sampling_params={**params, "max_new_tokens": 8})
        pid = e.roles.pids().get("scheduler")
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


def frame_cost(rows: int, frames: int = 3000) -> list[dict[str, object]]:
    from sgl.transports.curve import CurveClient, CurveServer
    from sgl.transports.factory import open_receiver, open_sender
    from sgl.transports.keys import new_pair

    b = BatchStrOutput([f"k{i:024x}:{i:032x}" for i in range(rows)], ["tok"] * rows, [[i] for i in range(rows)],
                       [None] * rows, [32] * rows, [7] * rows, [0] * rows, [None] * rows)
    out = []
    for mode in ("plain", "hmac", "curve", "plain", "hmac", "curve"):
        server, client = new_pair(), new_pair()
        key = secrets.token_hex(32) if mode == "hmac" else None
        curve = mode == "curve"
        recv = open_receiver("tcp://127.0.0.1:0", key, CurveServer(server, (client.public,)) if curve else None)
        send = open_sender(recv.address, key, curve=CurveClient(client, server.public) if curve else None)  # type: ignore[attr-defined]
        send.send(b)
        assert recv.recv(10) == b
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(frames):
            send.send(b)
            recv.recv(10)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        out.append({"tcp": mode, "frame bytes": len(msgspec_bytes(b)), "cpu us/frame": 1e6 * cpu / frames,
                    "wall us/frame": 1e6 * wall / frames})
        send.close()
        recv.close()
    return out


def msgspec_bytes(b: BatchStrOutput) -> bytes:
    from sgl.transports.codec import Codec

    return Codec().encode(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input", type=int, default=32)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--transport", default="ipc")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (W4); above 0 the sampler draws too")
    ap.add_argument("--tcp-security", default="", help="comma list of curve, hmac: tcp once per mode")
    ap.add_argument("--model-path", default=None, help="a model folder (config and tokenizer suffice: null weights)")
    ap.add_argument("--repeat", type=int, default=1, help="--tcp-security: rounds, modes interleaved")
    ap.add_argument("--frame-cost", action="store_true", help="CPU time per W4-sized frame per tcp mode")
    a = ap.parse_args()
    if a.frame_cost:
        rows = frame_cost(a.requests)
        print(f"W4 frame cost on {machine()}: a BatchStrOutput of {a.requests} rows, one tcp channel")
        print(table(rows))
        return
    from sgl.sched.models.default_model import default_model_dir

    model_dir = a.model_path or default_model_dir()
    if a.tcp_security:
        modes = a.tcp_security.split(",")
        assert set(modes) <= {"curve", "hmac"}, modes
        rows = [{"round": i, **asyncio.run(run(model_dir, a, overlap, m))}
                for i in range(a.repeat) for m in (modes if i % 2 == 0 else modes[::-1]) for overlap in (True, False)]
        print(f"W4 on {machine()}: null model, {a.requests} x {a.output} out, tcp")
        print(table(rows))
        best = {(m, lp): max(float(r["tok/s"]) for r in rows if r["tcp security"] == m and r["loop"] == lp)  # type: ignore[arg-type]
                for m in modes for lp in ("overlap", "normal")}
        print("RESULT name=W4-tcp best of " + str(a.repeat) + ": " + " ".join(
            f"{m}_{lp}_tok_s={v:.0f}" for (m, lp), v in best.items()))
        return
    rows = [asyncio.run(run(model_dir, a, overlap)) for overlap in (True, False)]
    print(f"W4 on {machine()}: null model, {a.requests} x {a.output} out, transport {a.transport}, "
          f"temperature {a.temperature:g}")
    print(table(rows))
    o = rows[0]
    print(f"RESULT name=W4 tok_s={o['tok/s']:.0f} sched_ms_per_step={o['sched ms/step']:.2f} "
          f"normal_tok_s={rows[1]['tok/s']:.0f}")


if __name__ == "__main__":
    main()
