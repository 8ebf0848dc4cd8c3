"""The sampler's unfiltered draw on a GPU at the workloads' batches (W2: every
row sampled at T = 0.6): sgl's one-pass Gumbel-max kernel (kernels/gumbel_draw.py, what
FusedDraw runs now) against what it replaced, the float32 copy of the logits divided by
the temperature and FlashInfer's `sampling_from_logits` over that copy, and against the
plain argmax of greedy batches. GPU microseconds per call (CUDA events), bf16 logits of
Qwen3's 151,936 ids, and the kernel's read rate.

    python -m benchmarks.draw_cost [--vocab 151936] [--batches 1,32,128,256]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import machine, table
from benchmarks.profile_decode import time_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--batches", default="1,32,128,256")
    args = ap.parse_args()
    import flashinfer

    from sgl.kernels.gumbel_draw import gumbel_draw

    dev = torch.device("cuda")
    seed = torch.zeros(1, dtype=torch.int64, device=dev)
    offset = torch.zeros(1, dtype=torch.int64, device=dev)
    rows = [_row(b, args.vocab, seed, offset, flashinfer.sampling.sampling_from_logits, gumbel_draw)
            for b in map(int, args.batches.split(","))]
    print(f"draw cost on {machine()}, vocab {args.vocab}, bf16 logits")
    print(table(rows))


def _row(b: int, vocab: int, seed: torch.Tensor, offset: torch.Tensor, fi_draw: object, one_pass: object) -> dict:
    logits = torch.randn(b, vocab, device=seed.device).to(torch.bfloat16)
    temp = torch.full((b, 1), 0.6, device=seed.device)
    before = time_us(lambda: fi_draw(logits / temp, seed=seed, offset=offset), reps=50)  # type: ignore[operator]
    us = time_us(lambda: one_pass(logits, temp, None, seed, offset), reps=50)  # type: ignore[operator]
    return {
        "rows": b,
        "divide + FlashInfer us": round(before, 1),
        "one-pass us": round(us, 1),
        "argmax us (greedy)": round(time_us(lambda: logits.argmax(dim=-1), reps=50), 1),
        "one-pass TB/s": round(logits.numel() * 2 / us / 1e6, 2),
    }


if __name__ == "__main__":
    main()
