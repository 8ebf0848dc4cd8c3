"""W2's decode attention, one layer, at the batches W2 really runs (issue 17): W2's
decode attention reads the KV at ~3.3 TB/s where W1's reads it at ~4.0 (profile_run),
and W2's batches mix contexts of 100 to 2,000 tokens. For a few of W2's decode steps
(the running requests' contexts at step t, all admitted at once as the engine does),
FlashInfer's decode kernel timed alone (CUDA events, page size 1, slots shuffled as in
a long-running pool) in the ways the engine could call it:

- graph: the engine's CUDA-graph wrapper (FlashInfer then always splits the KV when
  the batch leaves SMs idle, and never when batch x KV heads fill the grid);
- graph, sorted: the same with the batch's rows longest first (the blocks of the
  longest requests start first, so the last wave holds short ones);
- eager: the wrapper without graphs (splits only when that makes more blocks);
- tensor cores: FlashInfer's prefill kernel as decode (its own balanced split).

    python -m benchmarks.decode_balance [--steps 0,200,400,600,800,950]
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks.common import machine, table
from benchmarks.profile_decode import time_us

HQ, HKV, D = 16, 8, 128  # Qwen3-0.6B
KV_BYTES_PER_TOKEN = 2 * HKV * D * 2  # one layer, K and V, bf16


def w2_contexts(t: int, n: int = 256) -> list[int]:
    """The contexts of W2's running requests at decode step t (benchmarks/w1_w2_gpu.workload's draws)."""
    rng = random.Random(0)
    ins = [rng.randint(100, 1024) for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    return [i + t for i, o in zip(ins, outs) if o > t]


def plan(ws: torch.Tensor, lens: list[int], slots: torch.Tensor, graph: bool, tc: bool) -> object:
    """A decode wrapper planned for one batch (each variant plans right before it runs:
    wrappers sharing a workspace overwrite each other's plan)."""
    import flashinfer

    dev, b = slots.device, len(lens)
    indptr = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    if graph:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
            paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.empty(slots.numel(), dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device=dev), backend="fa2")
    else:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, backend="fa2")
    last = torch.ones(b, dtype=torch.int32).pin_memory()
    w.plan(indptr.pin_memory(), slots, last, HQ, HKV, D, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="0,200,400,600,800,950")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    pool = 600_000
    k = torch.randn(pool + 1, 1, HKV, D, dtype=dt, device=dev)
    v = torch.randn(pool + 1, 1, HKV, D, dtype=dt, device=dev)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows = []
    for t in (int(s) for s in a.steps.split(",")):
        lens = w2_contexts(t)
        b, total = len(lens), sum(lens)
        slots = (torch.randperm(pool, device=dev)[:total] + 1).to(torch.int32)
        q = torch.randn(b, HQ, D, dtype=dt, device=dev)
        by_len = sorted(lens, reverse=True)
        variants = {"graph": (lens, True, False), "graph, sorted": (by_len, True, False),
                    "eager": (lens, False, False), "tensor cores": (lens, False, True)}
        row: dict[str, object] = {"step": t, "batch": b, "mean ctx": total // b, "max ctx": max(lens)}
        for name, (ls, graph, tc) in variants.items():
            w = plan(ws, ls, slots, graph, tc)
            row[f"{name} us"] = time_us(lambda: w.run(q, (k, v)))  # type: ignore[attr-defined]  # noqa: B023
        row["us at 4 TB/s"] = total * KV_BYTES_PER_TOKEN / 4.0e12 * 1e6
        rows.append(row)
        print(row, flush=True)
    print(f"W2's decode attention, one layer, on {machine()}")
    print(table(rows))


if __name__ == "__main__":
    main()
