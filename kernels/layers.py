"""Small layer kernels: RMSNorm (with fused residual add), rotary embedding (Hugging
Face's rotate-half layout), SiLU-and-mul. Each function is the one dispatch point
for its op: FlashInfer's fused kernel for CUDA tensors when FlashInfer is
installed, pure torch otherwise (CPU, and the reference the tests compare with)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@functools.cache
def flashinfer_module() -> Any:
    """The flashinfer package, or None where it is not installed."""
    try:
        import flashinfer

        return flashinfer
    except ImportError:
        return None


def _gpu(x: torch.Tensor) -> Any:
    """FlashInfer when x lives on a GPU and FlashInfer is there, else None."""
    return flashinfer_module() if x.is_cuda and x.dtype != torch.float32 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (fi := _gpu(x)) is not None:
        if x.dim() == 3:  # per-head q/k norm: FlashInfer reads the strided view, no copy
            return fi.norm.rmsnorm(x, weight, eps)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return fi.norm.rmsnorm(flat, weight, eps).view(x.shape)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). On GPU both are computed in
    place: x becomes the normalised sum and residual the sum."""
    if (fi := _gpu(x)) is not None:
        fi.norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if (fi := _gpu(gate_up)) is not None:
        return fi.activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True, slots=True)
class RopeTables:
    """One model's rotary tables, built once with the model and owned by it (never a
    process-wide cache: two engines in one process each keep their own)."""

    cos: torch.Tensor  # [max_positions, head_dim] float32
    sin: torch.Tensor
    cos_sin: torch.Tensor  # FlashInfer's layout: [max_positions, head_dim], cos halves then sin halves


def rope_tables(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None, device: torch.device | str
) -> RopeTables:
    """The cos and sin tables of [max_positions, head_dim], float32, and FlashInfer's view of them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    half = head_dim // 2
    # All on the host, then moved: on the H200 host (torch 2.11) this cat on the GPU went
    # through a Python wrapper that imported torch._dynamo, 0.9 s of each start (py-spy).
    cos_sin = torch.cat([cos[:, :half], sin[:, :half]], dim=-1)
    return RopeTables(cos.to(device), sin.to(device), cos_sin.to(device))


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    import math

    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, smoothed, scaled)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RopeTables
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D]; positions: [T]."""
    if (fi := _gpu(q)) is not None:
        q, k = q.contiguous(), k.contiguous()
        d = q.shape[-1]
        fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.view(q.shape[0], -1), k.view(k.shape[0], -1), d, rope.cos_sin, is_neox=True)
        return q, k
    c = rope.cos[positions].unsqueeze(1)
    s = rope.sin[positions].unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * c + rotated * s).to(x.dtype)

    return rot(q), rot(k)
