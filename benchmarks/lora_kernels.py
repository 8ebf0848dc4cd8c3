"""The multi-LoRA GEMMs (kernels/lora.py) at Qwen3-0.6B's shapes on a GPU, against the
base projection they ride on: for qkv, o, gate_up and down (R = 16, 8 adapter slots,
bf16), at a decode batch (256 rows, one a request) and a prefill batch (8192 rows, 8
requests of 1024), with the rows' adapters drawn from 1 or from all 8 slots:

- base us: F.linear of the layer (the cost LoRA adds to);
- triton us / graph us: lora_apply on the Triton path, launched eagerly (host launch
  cost included when it exceeds the GPU time) and replayed from a CUDA graph over
  max_blocks buffers (what the engine's captured decode runs);
- torch us: the torch path (a gather, two matmuls and an index_add_ per slot used);
- err: the Triton result's and the torch path's largest absolute difference from a
  float64 computation of the same sum, and from each other (bf16 outputs of size ~1).

GPU microseconds are medians of 7 runs of 20 calls (CUDA events).

    python -m benchmarks.lora_kernels [--rank 16] [--slots 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import machine, table
from sgl.kernels.lora import LoraBatch, lora_apply

HIDDEN, Q, KV, INTER = 1024, 2048, 1024, 3072  # Qwen3-0.6B
LAYERS: dict[str, tuple[int, tuple[int, ...]]] = {  # name -> (K, sub sizes)
    "qkv": (HIDDEN, (Q, KV, KV)),
    "o": (Q, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTER, INTER)),
    "down": (INTER, (HIDDEN,)),
}


def time_us(fn: Callable[[], object], trials: int = 7, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(trials):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        runs.append(e0.elapsed_time(e1) / reps * 1e3)
    return statistics.median(runs)


def graph_us(fn: Callable[[], object]) -> float:
    """GPU microseconds per replay of fn captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_us(g.replay)


def weights(k: int, subs: tuple[int, ...], rank: int, slots: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The base weight [N, K] and the slots' a [S, n_sub*R, K], b [S, N, R], scaled so the
    base output and the delta are both of size ~1."""
    n = sum(subs)
    w = torch.randn(n, k, device=dev) / k**0.5
    a = torch.randn(slots, len(subs) * rank, k, device=dev) / k**0.5
    b = torch.randn(slots, n, rank, device=dev) / rank**0.5
    return w.bfloat16(), a.bfloat16(), b.bfloat16()


def run_case(name: str, slots: list[int], lens: list[int], rank: int, n_slots: int, dev: torch.device
             ) -> list[dict[str, object]]:
    t = sum(lens)
    tri = LoraBatch.from_runs(slots, lens, dev, triton=True)
    tor = LoraBatch.from_runs(slots, lens, dev, triton=False)
    dst = LoraBatch.buffers(LoraBatch.max_blocks(t, len(lens)), t, dev)
    tri.copy_into(dst)
    rows = []
    for layer, (k, subs) in LAYERS.items():
        w, a, b = weights(k, subs, rank, n_slots, dev)
        x = torch.randn(t, k, device=dev).bfloat16()
        y0 = F.linear(x, w)
        y = y0.clone()
        row: dict[str, object] = {"case": name, "layer": layer, "rows": t, "blocks": tri.block_len.shape[0]}
        row["base us"] = time_us(lambda: F.linear(x, w))  # noqa: B023
        row["triton us"] = time_us(lambda: lora_apply(x, y, a, b, subs, tri))  # noqa: B023
        row["graph us"] = graph_us(lambda: lora_apply(x, y, a, b, subs, dst))  # noqa: B023
        row["torch us"] = time_us(lambda: lora_apply(x, y, a, b, subs, tor))  # noqa: B023
        row["lora / base"] = f"{row['graph us'] / row['base us']:.2f}"  # type: ignore[operator]
        got_tri, got_tor = y0.clone(), y0.clone()
        lora_apply(x, got_tri, a, b, subs, tri)
        lora_apply(x, got_tor, a, b, subs, tor)
        exact = y0.double()
        lora_apply(x.double(), exact, a.double(), b.double(), subs, tor)
        errs = {"triton err": got_tri.double() - exact, "torch err": got_tor.double() - exact,
                "triton-torch": got_tri.double() - got_tor.double()}
        for col, d in errs.items():
            row[col] = f"{d.abs().max().item():.4f}"  # strings: the table prints floats to one decimal
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rng = random.Random(0)
    rows = []
    for adapters in (1, a.slots):
        decode = [rng.randrange(adapters) for _ in range(256)]
        rows += run_case(f"decode 256, {adapters} adapters", decode, [1] * 256, a.rank, a.slots, dev)
        prefill = [rng.randrange(adapters) for _ in range(8)]
        rows += run_case(f"prefill 8x1024, {adapters} adapters", prefill, [1024] * 8, a.rank, a.slots, dev)
    print(f"LoRA GEMMs at Qwen3-0.6B's shapes, R={a.rank}, {a.slots} slots, bf16, on {machine()}")
    print(table(rows))

    def overhead(case: str) -> float:
        sel = [r for r in rows if r["case"] == case]
        return sum(r["graph us"] for r in sel) / sum(r["base us"] for r in sel)  # type: ignore[misc]

    def worst(col: str) -> float:
        return max(float(str(r[col])) for r in rows)

    print(f"RESULT name=lora_kernels decode_lora_over_base={overhead(f'decode 256, {a.slots} adapters'):.2f} "
          f"prefill_lora_over_base={overhead(f'prefill 8x1024, {a.slots} adapters'):.2f} "
          f"triton_max_err={worst('triton err'):.4f} torch_max_err={worst('torch err'):.4f}")


if __name__ == "__main__":
    main()
