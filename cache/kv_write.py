"""Writing new K and V into the pool's per-layer buffers: two indexed copies, or, for
CUDA graph capture, one Triton launch per layer that writes both (and, into an FP8
pool, clamps and casts them: eight launches otherwise). Under a graph the
launch cost is paid once at capture, and the one kernel takes 1.7 us of GPU time
against 2 x 3.5 us (batch 256, an H200). Eager forwards keep the copies: there the
decode step is bound by host-side launches, and Triton's launcher is the slower one
(W1's eager decode step, same machine: 14.5 ms with it, 13.0 ms with the copies).
It writes only: which slots a batch gets is the allocator's business."""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _triton_kernel() -> Any:
    """The Triton kernel, or None where Triton is not installed (CPU builds of torch)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def write_kv(k_ptr, v_ptr, k_buf, v_buf, loc_ptr, k_row, k_head, v_row, v_head,
                 H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 LIMIT: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        slot = tl.load(loc_ptr + i).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < H) & (d < D)
        dst = slot * (H * D) + h * D + d  # buffers are contiguous [slots, H, D]
        k = tl.load(k_ptr + i * k_row + h * k_head + d, mask=mask)
        v = tl.load(v_ptr + i * v_row + h * v_head + d, mask=mask)
        if LIMIT > 0:  # into FP8: clamped to its range first, as _cast does
            k = tl.clamp(k.to(tl.float32), -LIMIT, LIMIT)
            v = tl.clamp(v.to(tl.float32), -LIMIT, LIMIT)
        tl.store(k_buf + dst, k.to(k_buf.dtype.element_ty), mask=mask)
        tl.store(v_buf + dst, v.to(v_buf.dtype.element_ty), mask=mask)

    return write_kv


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the pool's dtype; into FP8 clamped to its range first (a cast past it may give
    NaN, which attention would spread over the whole row)."""
    if _is_fp8(dtype):
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             one_launch: bool = False) -> None:
    """k_buf[loc] = k and v_buf[loc] = v, cast to the buffers' dtype. k, v: [n, H, D]
    (views with a unit last stride are read in place); loc: [n] slots, distinct but for
    padding rows of a CUDA graph batch, which all write slot 0 (never read).
    `one_launch`: through the Triton kernel where it applies (see the module note)."""
    n, h, d = k.shape
    kernel = _triton_kernel() if one_launch and k.is_cuda else None
    fp8 = _is_fp8(k_buf.dtype)
    if (kernel is None or n == 0 or not (k.dtype == k_buf.dtype or fp8) or k_buf.dtype != v_buf.dtype
            or k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_buf.is_contiguous() and v_buf.is_contiguous())):
        k_buf[loc] = _cast(k, k_buf.dtype)
        v_buf[loc] = _cast(v, v_buf.dtype)
        return
    kernel[(n,)](k, v, k_buf, v_buf, loc, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 H=h, D=d, BLOCK_H=_next_pow2(h), BLOCK_D=_next_pow2(d),
                 LIMIT=torch.finfo(k_buf.dtype).max if fp8 else 0.0)
