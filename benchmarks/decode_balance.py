"""Decode attention, one layer, at the batches W1, W2 and W3 really run, through
the engine's own FlashInfer backend: W2's batches mix contexts of 100 to 2,000 tokens
(its decode attention read the KV at ~3.3 TB/s where W1's uniform batch read it at
~4.0), W1's are uniform, W3's cascade suffixes short and uniform. For each batch (the
running requests' contexts at step t, all admitted at once as the engine does; slots
shuffled as in a long-running pool), the kernel timed alone (CUDA events) as the
engine can run it:

- decode / tensor cores: FlashInfer's decode kernel, or its prefill kernel as decode
  (`tensor_core_decode_min_batch` picks between them by batch size);
- graph / eager: the CUDA-graph wrapper of the batch's size, or the eager one;
- plan us: the host time of the graph wrapper's plan, which the scheduler's thread
  pays each step;
- with `--others`: the kernels the engine does not run yet, each captured in a CUDA
  graph: sgl's Triton decode (kernels/triton_decode.py) on the bf16 pool and on an FP8
  (e4m3) copy of it, FlashInfer's decode and tensor-core kernels reading that FP8 copy,
  and FlashInfer's tensor-core decode on its FA3 backend.

    python -m benchmarks.decode_balance [--w2-steps 0,200,400,600,800,950] [--w1-steps 0,256,511] [--others]
    python -m benchmarks.decode_balance --sweep [--sweep-heads 32,8]   # the Triton kernel's settings
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import machine, table
from benchmarks.profile_decode import graph_us, time_us

HQ, HKV, D = 16, 8, 128  # Qwen3-0.6B
KV_BYTES_PER_TOKEN = 2 * HKV * D * 2  # one layer, K and V, bf16
MAX_BS = 256


def w2_contexts(t: int, n: int = 256) -> list[int]:
    """The contexts of W2's running requests at decode step t (benchmarks/w1_w2_gpu.workload's draws)."""
    rng = random.Random(0)
    ins = [rng.randint(100, 1024) for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    return [i + t for i, o in zip(ins, outs) if o > t]


def cases(w2_steps: list[int], w1_steps: list[int]) -> list[tuple[str, list[int]]]:
    out = [(f"W2 t={t}", w2_contexts(t)) for t in w2_steps]
    out += [(f"W1 t={t}", [512 + t] * MAX_BS) for t in w1_steps]
    out += [(f"W3 suffix t={t}", [100 + t] * MAX_BS) for t in (0, 127)]  # what a cascade's suffix decode reads
    out += [(f"W3 t={t}", [2100 + t] * MAX_BS) for t in (0, 127)]  # W3 without cascade: the whole context
    return out


def plan_us(backend: object, bs: int, indptr: torch.Tensor, slots: torch.Tensor, tc: bool, reps: int = 20) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        backend.begin_graph_decode(bs, indptr, slots, tc)  # type: ignore[attr-defined]
    return (time.perf_counter() - t0) / reps * 1e6


def others(row: dict[str, object], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k8: torch.Tensor,
           v8: torch.Tensor, indptr: torch.Tensor, slots: torch.Tensor) -> None:
    """The kernels the engine does not run (yet), on the same batch."""
    import flashinfer

    from sgl.kernels.triton_decode import decode_attention

    dev_indptr = indptr.to(q.device)
    scale = D**-0.5
    for name, kc, vc in (("triton", k, v), ("triton fp8", k8, v8)):
        row[f"{name} us"] = graph_us(lambda: decode_attention(q, kc, vc, dev_indptr, slots, scale))  # noqa: B023
    for sp in (1, 2, 4):
        row[f"triton s{sp} us"] = graph_us(lambda: decode_attention(q, k, v, dev_indptr, slots, scale, splits=sp))  # noqa: B023
    b = q.shape[0]
    lens = (indptr[1:] - indptr[:-1]).pin_memory()
    ones = torch.ones(b, dtype=torch.int32).pin_memory()
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    for name, tc, backend, kc, vc in (("fi fp8 decode", False, "fa2", k8, v8), ("fi fp8 tc", True, "fa2", k8, v8),
                                      ("fa3 tc", True, "fa3", k, v)):
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, backend=backend)
            w.plan(indptr, slots, ones, HQ, HKV, D, 1, q_data_type=q.dtype, kv_data_type=kc.dtype,
                   seq_lens=lens if tc else None)
            kv = (kc.unsqueeze(1), vc.unsqueeze(1))
            row[f"{name} us"] = time_us(lambda: w.run(q, kv))  # noqa: B023
        except Exception as e:  # noqa: BLE001 - a kernel this FlashInfer lacks: say so, go on
            row[f"{name} us"] = f"n/a: {type(e).__name__}"


def sweep(cases: list[tuple[str, list[int]]], k: torch.Tensor, v: torch.Tensor, k8: torch.Tensor | None,
          v8: torch.Tensor | None, pool: int, hq: int) -> None:
    """The Triton kernel's settings on a few batches: pool type (FP8 unless k8 is None),
    products in fp16, slots per iteration, warps, pipeline stages (us per call from a CUDA
    graph, and the KV read rate)."""
    from sgl.kernels.triton_decode import decode_attention

    dev = k.device
    rows = []
    for name, lens in cases:
        b, total = len(lens), sum(lens)
        slots = (torch.randperm(pool, device=dev)[:total] + 1).to(torch.int32)
        indptr = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
        q = torch.randn(b, hq, D, dtype=k.dtype, device=dev)
        for kv, kc, vc in (("bf16", k, v), ("fp8", k8, v8)):
            if kc is None:
                continue
            for fp16 in ((False,) if kv == "bf16" else (False, True)):
                for block in (32, 64, 128):
                    for warps in (4, 8):
                        for stages in (2, 3):
                            us = graph_us(lambda: decode_attention(
                                q, kc, vc, indptr, slots, D**-0.5, num_warps=warps, num_stages=stages,  # noqa: B023
                                block_n=block, fp16=fp16))  # noqa: B023
                            read = total * k.shape[1] * D * 2 * kc.element_size()
                            rows.append({"batch": name, "kv": kv, "fp16": fp16, "block": block, "warps": warps,
                                         "stages": stages, "us": us, "TB/s": read / us / 1e6})
        best = sorted((r for r in rows if r["batch"] == name), key=lambda r: (r["kv"], r["us"]))
        print(name, [(r["kv"], r["fp16"], r["block"], r["warps"], r["stages"], round(r["us"], 1))
                     for r in best if r["kv"] == "bf16"][:4],
              [(r["kv"], r["fp16"], r["block"], r["warps"], r["stages"], round(r["us"], 1))
               for r in best if r["kv"] == "fp8"][:6], flush=True)
    print(table(rows))


def main() -> None:
    from sgl.kernels.attention import AttnMetadata
    from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

    ap = argparse.ArgumentParser()
    ap.add_argument("--w2-steps", default="0,200,400,600,800,950")
    ap.add_argument("--w1-steps", default="0,256,511")
    ap.add_argument("--others", action="store_true", help="also the kernels the engine does not run (see above)")
    ap.add_argument("--sweep", action="store_true", help="the Triton kernel's settings alone")
    ap.add_argument("--sweep-heads", default=f"{HQ},{HKV}",
                    help="query,KV heads for --sweep (32,8: Qwen3-8B's, bf16 pool only)")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    pool = 600_000
    if a.sweep:
        hq, hkv = map(int, a.sweep_heads.split(","))
        k = torch.randn(pool + 1, hkv, D, dtype=dt, device=dev)
        v = torch.randn(pool + 1, hkv, D, dtype=dt, device=dev)
        fp8 = (hq, hkv) == (HQ, HKV)
        k8, v8 = (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) if fp8 else (None, None)
        sweep(cases([0, 400], [256])[:3], k, v, k8, v8, pool, hq)
        return
    k = torch.randn(pool + 1, HKV, D, dtype=dt, device=dev)
    v = torch.randn(pool + 1, HKV, D, dtype=dt, device=dev)
    k8, v8 = (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) if a.others else (k, v)
    backends = {"decode": FlashInferAttentionBackend(HQ, HKV, D, dt, dev, pool + 1, 4096, tensor_core_min_batch=10**9),
                "tensor cores": FlashInferAttentionBackend(HQ, HKV, D, dt, dev, pool + 1, 4096,
                                                           tensor_core_min_batch=1)}
    for be in backends.values():
        be.init_graph(MAX_BS, cascade=False)  # the largest first: it sizes the shared index buffers
    rows = []
    for name, lens in cases([int(s) for s in a.w2_steps.split(",")], [int(s) for s in a.w1_steps.split(",")]):
        b, total = len(lens), sum(lens)
        slots = (torch.randperm(pool, device=dev)[:total] + 1).to(torch.int32)
        indptr = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32).pin_memory()
        q = torch.randn(b, HQ, D, dtype=dt, device=dev)
        row: dict[str, object] = {"batch": name, "rows": b, "mean ctx": total // b, "max ctx": max(lens)}
        for kind, be in backends.items():
            if b not in be.graph_decode:
                be.init_graph(b, cascade=False)
            row[f"{kind} plan us"] = plan_us(be, b, indptr, slots, kind != "decode")  # leaves it planned
            row[f"{kind} graph us"] = time_us(lambda: be.forward(q, q, q, k, v, D**-0.5))  # noqa: B023
            # shared_len = the whole mean row: the tensor-core backend's eager pick is the tensor-core kernel
            be.begin_forward(AttnMetadata(True, indptr.to(dev), indptr.to(dev), slots, [1] * b, lens, indptr, indptr,
                                          shared_len=total))
            row[f"{kind} eager us"] = time_us(lambda: be.forward(q, q, q, k, v, D**-0.5))  # noqa: B023
        if a.others:
            others(row, q, k, v, k8, v8, indptr, slots)
        row["us at 4 TB/s"] = total * KV_BYTES_PER_TOKEN / 4.0e12 * 1e6
        rows.append(row)
        print(row, flush=True)
    print(f"Decode attention, one layer (kernel us; plan us on the host), on {machine()}")
    print(table(rows))


if __name__ == "__main__":
    main()
