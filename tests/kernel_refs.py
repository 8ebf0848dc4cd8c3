"""What sgl's own kernels must compute, in float32 through the torch paths: decode
attention over the pool (the torch reference backend) and the QKV epilogue (norms and
rotary). Shared by the GPU tests of the compiled kernels and the CPU tests that run them
in Triton's interpreter."""

from __future__ import annotations

import torch

from sgl.kernels.attention import AttnMetadata
from sgl.kernels.layers import RopeTables, apply_rope, rms_norm
from sgl.kernels.torch_attention import TorchAttentionBackend


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: list[int],
                     indices: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row attending to its `lens[i]` slots of `indices`, in float32."""
    b, dev = len(lens), q.device
    qo = torch.arange(b + 1, dtype=torch.int32)
    kv = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    ref = TorchAttentionBackend()
    ref.begin_forward(AttnMetadata(True, qo.to(dev), kv.to(dev), indices, [1] * b, lens, kv, qo))
    return ref.forward(q.float(), q, q, k_cache.float(), v_cache.float(), scale)


def norm_rope_reference(qkv: torch.Tensor, hq: int, hkv: int, d: int, q_weight: torch.Tensor | None,
                        k_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                        rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k normed (with both weights) and rotated, and v, as float32 [T, heads, d]
    (float32 inputs take the torch path on a GPU too, not FlashInfer's kernels)."""
    t = qkv.shape[0]
    q, k, v = qkv.float().split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.reshape(t, hkv, d)
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight.float(), eps), rms_norm(k, k_weight.float(), eps)
    q, k = apply_rope(q, k, positions, rope)
    return q, k, v
