"""FP8 weights' projections alone (kernels/fp8_linear.py) against bf16's, at an architecture's
shapes and the token counts of decode batches and prefill chunks: microseconds per call
of the bf16 GEMM, of the FP8 path whole (the activations' quantization, then the scaled
GEMM) and of each of its two parts, of the weight-only product (up to 64 tokens, on a GPU
that converts FP8), and the 16-bit weight read's time at the GPU's bandwidth. On a GPU
each figure is a call captured in a CUDA graph and replayed 20 times (as the engine
replays decode), so launch gaps do not count; on a CPU (a check that it runs) wall time.

`--sweep` also times the weight-only product at each setting of WEIGHT_ONLY_SWEEP (output
channels and K per program, K split over programs, pipeline stages) and names the fastest.

    python -m benchmarks.fp8_gemm [--config qwen3-8b] [--tokens 1,16,64,128,256,2048] [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import machine, table
from benchmarks.profile_decode import graph_us
from sgl.kernels.fp8_linear import WEIGHT_ONLY_MAX_M, fp8_linear, quantize_rows, weight_only_linear
from sgl.kernels.triton_decode import handles

REPS = 20
HBM_TB_S = 4.8  # an H200's
# weight_only_linear's settings --sweep tries: (block_n, block_k, split_k, num_stages), 4 warps.
WEIGHT_ONLY_SWEEP = [(bn, bk, sk, st) for bn in (32, 64) for bk in (128, 256) for sk in (1, 2, 4) for st in (3, 4)]


def projections(config: dict) -> list[tuple[str, int, int]]:
    """(name, in features K, out features N) of one decoder layer's four projections."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return [("qkv", hidden, q + 2 * kv), ("o", q, hidden), ("gate_up", hidden, 2 * inter), ("down", inter, hidden)]


def time_us(fn: Callable[[], object], device: torch.device) -> float:
    """Microseconds per call: replayed from a CUDA graph on a GPU, wall time on a CPU."""
    if device.type == "cuda":
        return graph_us(fn, REPS)
    fn()
    t = time.perf_counter()
    for _ in range(REPS):
        fn()
    return (time.perf_counter() - t) / REPS * 1e6


def weight_only_sweep(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> tuple[float, str]:
    """The fastest of WEIGHT_ONLY_SWEEP's settings for this product: (us, its setting)."""
    best = (float("inf"), "")
    for bn, bk, sk, st in WEIGHT_ONLY_SWEEP:
        call = functools.partial(weight_only_linear, x, qw, sw, block_n=bn, block_k=bk, split_k=sk, num_stages=st)
        us = time_us(call, x.device)
        best = min(best, (us, f"n{bn} k{bk} split{sk} stages{st}"))
    return round(best[0], 1), best[1]


def row(name: str, k: int, n: int, m: int, device: torch.device, dtype: torch.dtype, sweep: bool = False) -> dict:
    g = torch.Generator(device=device).manual_seed(k * n + m)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(dtype)
    qw, sw = quantize_rows(w)
    sw = sw.view(-1)
    qx, sx = quantize_rows(x)
    mm_dtype = torch.bfloat16 if device.type == "cuda" else dtype
    one = torch.ones((), dtype=torch.float32, device=device)
    bf16 = time_us(lambda: F.linear(x, w), device)
    fp8 = time_us(lambda: fp8_linear(x, qw, sw, dtype), device)
    # The weight-only product where it runs (decode-sized batches, a GPU that converts FP8).
    runs = m <= WEIGHT_ONLY_MAX_M and handles(device, qw.dtype)
    weight_only = round(time_us(lambda: weight_only_linear(x, qw, sw), device), 1) if runs else None
    best = weight_only_sweep(x, qw, sw) if runs and sweep else None
    swept = {"weight-only best us": best[0], "its setting": best[1]} if best else {}
    return {"proj": name, "K x N": f"{k} x {n}", "tokens": m, "unquantized us": round(bf16, 1), "fp8 us": round(fp8, 1),
            "weight-only us": weight_only, **swept,
            "quantize us": round(time_us(lambda: quantize_rows(x), device), 1),
            "scaled_mm us": round(time_us(lambda: torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.view(1, n),
                                                                    out_dtype=mm_dtype), device), 1),
            "scaled_mm fast-accum us": round(time_us(lambda: torch._scaled_mm(
                qx, qw.t(), scale_a=sx, scale_b=sw.view(1, n), out_dtype=mm_dtype, use_fast_accum=True), device), 1),
            # One scale per tensor (cuBLASLt on a GPU), the per-row and per-channel scales then
            # applied to the product by one multiply: what a fused epilogue would cost at most.
            "tensor-scaled mm + scales us": round(time_us(lambda: torch._scaled_mm(
                qx, qw.t(), scale_a=one, scale_b=one, out_dtype=mm_dtype) * sx * sw.view(1, n), device), 1),
            "tensor-scaled mm us": round(time_us(lambda: torch._scaled_mm(
                qx, qw.t(), scale_a=one, scale_b=one, out_dtype=mm_dtype), device), 1),
            "unquantized / fp8": round(bf16 / fp8, 2),
            "16-bit weight read us": round(n * k * 2 / (HBM_TB_S * 1e6), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="qwen3-8b", help="an architecture of benchmarks/configs")
    ap.add_argument("--tokens", default="1,16,64,128,256,2048")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sweep", action="store_true", help="time the weight-only product's settings too")
    args = ap.parse_args()
    config = json.loads((Path(__file__).parent / "configs" / f"{args.config}.json").read_text())
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [row(name, k, n, m, device, dtype, args.sweep) for name, k, n in projections(config)
            for m in map(int, args.tokens.split(","))]
    print(f"FP8 projections against {str(dtype).removeprefix('torch.')}, {args.config}, on {machine()}")
    print(table(rows))


if __name__ == "__main__":
    main()
