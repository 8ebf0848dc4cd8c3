"""One kernel from the QKV projection to attention's inputs: each query and key head's
RMSNorm (Qwen3's q_norm / k_norm; skipped for models without), rotary embedding (the
rotate-half layout of sgl.kernels.layers.apply_rope), and the new tokens' K and V
written into the layer's pool (cast, and clamped into an FP8 pool's range, as
sgl.cache.kv_write does). In Triton, for CUDA tensors.

Why: unfused these are five to eight launches a layer (two norms, rotary, two copies to
make q and k contiguous, the KV write), each a few microseconds at decode batch sizes
where the whole layer is ~30 us of work besides attention: on an H200 a W2 decode step
spent ~0.2 ms in them (benchmarks/RESULTS.md, 2026-12-02). Each value is rounded to the
model's dtype where the unfused path stores it (after the norm, after the rotation), so
the two agree to the last bit but for the order of float32 operations. It runs for every
forward on a GPU (eager and captured), so eager and graph decode give the same numbers.

It computes only: which slots the new tokens take is the allocator's business."""

from __future__ import annotations

import functools
from typing import Any

import torch

from sgl.kernels.triton_decode import handles, is_fp8

BLOCK_H = 8  # heads per program


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def norm_rope_store(qkv_ptr, q_out, k_out, k_buf, v_buf, loc_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, eps,
                        stride_t, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                        NORM: tl.constexpr, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # q heads, then k heads
        j = tl.arange(0, HALF_PAD)
        jm = (j < HALF)[None, :]
        live = (heads < HQ + HKV)[:, None] & jm
        is_q = (heads < HQ)[:, None] & jm
        is_k = live & (heads >= HQ)[:, None]
        row = qkv_ptr + t * stride_t + heads[:, None] * (2 * HALF) + j[None, :]
        x1 = tl.load(row, mask=live, other=0.0)
        dt = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = tl.load(row + HALF, mask=live, other=0.0).to(tl.float32)
        if NORM:
            jj = j < HALF
            w1 = tl.where(is_q, tl.load(qw_ptr + j, mask=jj)[None, :], tl.load(kw_ptr + j, mask=jj)[None, :])
            w2 = tl.where(is_q, tl.load(qw_ptr + HALF + j, mask=jj)[None, :],
                          tl.load(kw_ptr + HALF + j, mask=jj)[None, :])
            w1, w2 = w1.to(tl.float32), w2.to(tl.float32)
            r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
            x1 = (x1 * r * w1).to(dt).to(tl.float32)
            x2 = (x2 * r * w2).to(dt).to(tl.float32)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_sin_ptr + pos * (2 * HALF) + j, mask=j < HALF, other=0.0)[None, :]
        s = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + j, mask=j < HALF, other=0.0)[None, :]
        o1 = (x1 * c - x2 * s).to(dt)
        o2 = (x2 * c + x1 * s).to(dt)
        qo = q_out + t * (HQ * 2 * HALF) + heads[:, None] * (2 * HALF) + j[None, :]
        tl.store(qo, o1, mask=is_q)
        tl.store(qo + HALF, o2, mask=is_q)
        kh = heads - HQ
        ko = k_out + t * (HKV * 2 * HALF) + kh[:, None] * (2 * HALF) + j[None, :]
        tl.store(ko, o1, mask=is_k)
        tl.store(ko + HALF, o2, mask=is_k)
        slot = tl.load(loc_ptr + t).to(tl.int64)
        dst = slot * (HKV * 2 * HALF) + kh[:, None] * (2 * HALF) + j[None, :]  # pools: contiguous [slots, HKV, D]
        vrow = qkv_ptr + t * stride_t + (HQ + HKV + kh[:, None]) * (2 * HALF) + j[None, :]
        v1 = tl.load(vrow, mask=is_k, other=0.0)
        v2 = tl.load(vrow + HALF, mask=is_k, other=0.0)
        k1, k2 = o1, o2
        if LIMIT > 0:  # an FP8 pool: clamped into its range first
            k1 = tl.clamp(k1.to(tl.float32), -LIMIT, LIMIT)
            k2 = tl.clamp(k2.to(tl.float32), -LIMIT, LIMIT)
            v1 = tl.clamp(v1.to(tl.float32), -LIMIT, LIMIT)
            v2 = tl.clamp(v2.to(tl.float32), -LIMIT, LIMIT)
        et = k_buf.dtype.element_ty
        tl.store(k_buf + dst, k1.to(et), mask=is_k)
        tl.store(k_buf + dst + HALF, k2.to(et), mask=is_k)
        tl.store(v_buf + dst, v1.to(et), mask=is_k)
        tl.store(v_buf + dst + HALF, v2.to(et), mask=is_k)

    return norm_rope_store


def available(device: torch.device, dtype: torch.dtype, pool_dtype: torch.dtype) -> bool:
    """Whether the kernel runs for a model's activations and KV pool: CUDA, 16-bit
    activations, Triton installed, and for an FP8 pool a GPU that converts to FP8
    (compute capability 8.9+; sgl.kernels.triton_decode.handles)."""
    return dtype in (torch.bfloat16, torch.float16) and handles(torch.device(device), pool_dtype)


def norm_rope_store(qkv: torch.Tensor, hq: int, hkv: int, head_dim: int, q_weight: torch.Tensor | None,
                    k_weight: torch.Tensor | None, eps: float, positions: torch.Tensor, cos_sin: torch.Tensor,
                    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (hq + 2 hkv) x head_dim], rows with a unit last stride; q_weight, k_weight:
    [head_dim] RMSNorm weights (both None: no norm); positions, loc: [T]; cos_sin:
    [positions, head_dim] float32 (cos halves, then sin halves); k_buf, v_buf: the
    layer's pool, contiguous [slots, hkv, head_dim]. Writes K and V at `loc` and returns
    q [T, hq, head_dim] and k [T, hkv, head_dim] (new, contiguous, normed and rotated)
    and v (a view of qkv)."""
    t = qkv.shape[0]
    assert qkv.stride(-1) == 1 and k_buf.is_contiguous() and v_buf.is_contiguous() and head_dim % 2 == 0
    q = torch.empty(t, hq, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, hkv, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (hq + hkv) * head_dim:].view(t, hkv, head_dim)
    if t == 0:
        return q, k, v
    norm = q_weight is not None and k_weight is not None
    pool = k_buf.dtype
    limit = torch.finfo(pool).max if is_fp8(pool) else 0.0
    _kernel()[(t, -(-(hq + hkv) // BLOCK_H))](
        qkv, q, k, k_buf, v_buf, loc, positions, cos_sin, q_weight if norm else qkv, k_weight if norm else qkv,
        eps, qkv.stride(0), HQ=hq, HKV=hkv, HALF=head_dim // 2, HALF_PAD=1 << (head_dim // 2 - 1).bit_length(),
        NORM=norm, LIMIT=limit, BLOCK=BLOCK_H,
        num_warps=4)
    return q, k, v
