"""Writing new K and V into the pool's per-layer buffers: two indexed copies, cast (and
clamped into an FP8 pool's range) to the pool's dtype. The CPU path, and the reference the
GPU tests hold sgl.kernels.norm_rope_store to: on a GPU the model writes its K and V in
that fused kernel instead, which includes the KV write.
It writes only: which slots a batch gets is the allocator's business."""

from __future__ import annotations

import torch


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the pool's dtype; into FP8 clamped to its range first (a cast past it may give
    NaN, which attention would spread over the whole row)."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buf[loc] = k and v_buf[loc] = v, cast to the buffers' dtype. k, v: [n, H, D];
    loc: [n] slots, distinct but for padding rows of a CUDA graph batch, which all write
    slot 0 (never read)."""
    k_buf[loc] = _cast(k, k_buf.dtype)
    v_buf[loc] = _cast(v, v_buf.dtype)
