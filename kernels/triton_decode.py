"""Decode attention over the page-size-1 KV pool in Triton: one query token per row,
any KV element type the pool holds (bf16/fp16, or FP8 read and widened in registers).

Why a kernel of our own: FlashInfer 0.6.5's decode kernels read an FP8 pool slower than
a bf16 one on an H200 (W1 5% and W2 15% slower end to end, benchmarks/RESULTS.md,
2026-12-02), and its FP8-fast decode (XQA) needs pages of 16+ slots, which this pool
does not have. Decode attention is memory-bound (W2: 70% of the GPU time), so a kernel
that reads one byte per element where bf16 reads two could nearly halve it; this one
reads an FP8 pool 11-21% faster than a bf16 one, and a bf16 pool as fast as the faster
of FlashInfer's two decode kernels (same measurements).

Work split: one program per (row, KV head, split). It gathers BLOCK_N slots at a time
(each slot's head row is D contiguous elements), scores them for the KV head's G query
heads with one small tensor-core product (G rows padded to 16), and keeps an online
softmax. Rows are cut into `splits` equal chunks, chosen from the batch size alone, so a
CUDA graph of one size always launches the same grid; with more than one split a
second kernel merges the chunks by their log-sum-exp. The split count is an argument,
not a compile-time constant, so a process compiles three kernels (one chunk, several,
the merge) per head shape and element type, not one per batch size.

It computes attention only: which slots a row reads is the caller's (kv_indptr and
kv_indices, as FlashInfer takes them, on the device)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from sgl.kernels import triton_runs_on

# Settings measured on an H200 (decode_balance --sweep, RESULTS.md 2026-12-02): 128 slots per
# iteration, 4 warps, 3 stages were the fastest or within 2% at W1's and W2's batches, bf16 and FP8.
BLOCK_N = 128  # slots per iteration
NUM_WARPS = 4
NUM_STAGES = 3
TARGET_PROGRAMS = 1024  # (rows x KV heads x splits) a launch aims at: ~8 per SM of an H200
MAX_SPLITS = 16


def splits_for(batch: int, kv_heads: int) -> int:
    """Chunks per row for a batch of this many rows: enough programs to fill the GPU."""
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // (batch * kv_heads))))


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["splits"])  # one compile for every split count
    def partial(q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, o_ptr, mid_o_ptr, mid_lse_ptr, scale_log2,
                stride_qb, stride_qh, stride_ob, stride_oh, splits,
                HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                ONE: tl.constexpr, BLOCK: tl.constexpr, FP16: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        start = tl.load(indptr_ptr + b)
        n = tl.load(indptr_ptr + b + 1) - start
        chunk = tl.cdiv(tl.cdiv(n, splits), BLOCK) * BLOCK
        lo = s * chunk
        hi = tl.minimum(lo + chunk, n)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)  # head sizes that are not a power of two: padded with zeros
        heads = h * G + g
        qm = (g < G)[:, None]
        if D_PAD != D:  # only then a mask along d (one there would cost the loads their vector width)
            qm = qm & (d < D)[None, :]
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qm, other=0.0)
        if FP16:  # the products in fp16: FP8 widens to it in one instruction, to bf16 not
            q = q.to(tl.float16)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        den = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for off in range(lo, hi, BLOCK):
            j = off + tl.arange(0, BLOCK)
            valid = j < hi
            slot = tl.load(indices_ptr + start + j, mask=valid, other=0).to(tl.int64)
            row = slot[:, None] * (HKV * D) + h * D + d[None, :]  # the pool is contiguous [slots, HKV, D]
            km = valid[:, None]
            if D_PAD != D:
                km = km & (d < D)[None, :]
            kk = tl.load(k_ptr + row, mask=km, other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(kk)) * scale_log2  # [G_PAD, BLOCK], log2 units
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            den = den * alpha + tl.sum(p, 1)
            vv = tl.load(v_ptr + row, mask=km, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vv)
            m = m_new
        live = den > 0.0  # an empty chunk (a short row cut into many) has no slot
        out = acc / tl.where(live, den, 1.0)[:, None]
        if ONE:  # one chunk per row: the output itself
            tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=qm)
        else:
            hq = HKV * G
            at = (b * hq + heads) * splits + s  # mid buffers: [B, HQ, splits(, D)]
            tl.store(mid_o_ptr + at[:, None] * D + d[None, :], out, mask=qm)
            lse = tl.where(live, m + tl.log2(tl.where(live, den, 1.0)), float("-inf"))
            tl.store(mid_lse_ptr + at, lse, mask=g < G)

    @triton.jit(do_not_specialize=["splits"])
    def merge(mid_o_ptr, mid_lse_ptr, o_ptr, stride_ob, stride_oh, splits, HQ: tl.constexpr, D: tl.constexpr,
              D_PAD: tl.constexpr, MAX: tl.constexpr):
        b = tl.program_id(0)
        hd = tl.program_id(1)
        s = tl.arange(0, MAX)
        d = tl.arange(0, D_PAD)
        at = (b * HQ + hd) * splits + s
        lse = tl.load(mid_lse_ptr + at, mask=s < splits, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))  # every row has a slot, so one chunk at least is live
        om = (s < splits)[:, None]
        if D_PAD != D:
            om = om & (d < D)[None, :]
        o = tl.load(mid_o_ptr + at[:, None] * D + d[None, :], mask=om, other=0.0)
        out = (tl.sum(o * w[:, None], 0) / tl.sum(w, 0)).to(o_ptr.dtype.element_ty)
        if D_PAD != D:
            tl.store(o_ptr + b * stride_ob + hd * stride_oh + d, out, mask=d < D)
        else:
            tl.store(o_ptr + b * stride_ob + hd * stride_oh + d, out)

    return partial, merge


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def handles(device: torch.device, pool_dtype: torch.dtype) -> bool:
    """Whether sgl's Triton kernels run on `device` over a pool of `pool_dtype`: a CUDA
    device, Triton installed, and for FP8 compute capability 8.9+ (where the GPU converts
    FP8; Triton refuses FP8 below it)."""
    if not triton_runs_on(device):
        return False
    if is_fp8(pool_dtype):
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return True


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, scale: float, splits: int | None = None,
                     num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, block_n: int = BLOCK_N,
                     fp16: bool | None = None) -> torch.Tensor:
    """q: [B, HQ, D]; k_cache, v_cache: [slots, HKV, D] contiguous (bf16/fp16, or FP8
    read unscaled); kv_indptr: [B + 1] int32 and kv_indices: [total] int32, on q's
    device, every row at least one slot. Returns [B, HQ, D] in q's dtype. `splits`:
    chunks per row (None: splits_for(B, HKV)); fixed for a given batch size, so a CUDA
    graph can capture the call. `fp16`: the products in fp16 (None: for FP8 pools)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    splits = splits or splits_for(b, hkv)
    assert 1 <= splits <= MAX_SPLITS
    partial, merge = _kernels()
    o = torch.empty_like(q)
    if splits > 1:
        mid_o = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = o  # not read
    partial[(b, hkv, splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, o, mid_o, mid_lse, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), splits,
        HKV=hkv, G=g, G_PAD=max(16, triton_next_pow2(g)), D=d, D_PAD=max(16, triton_next_pow2(d)), ONE=splits == 1,
        BLOCK=block_n,
        FP16=is_fp8(k_cache.dtype) if fp16 is None else fp16, num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        merge[(b, hq)](mid_o, mid_lse, o, o.stride(0), o.stride(1), splits, HQ=hq, D=d,
                       D_PAD=max(16, triton_next_pow2(d)), MAX=MAX_SPLITS, num_warps=4)
    return o


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
