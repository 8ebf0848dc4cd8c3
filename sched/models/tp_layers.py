"""The model's layers that tensor parallelism changes, and the arithmetic of which
part of the model a rank holds: a linear layer (column-parallel by its shape alone,
row-parallel with a group to sum over), the vocab-parallel embedding, each rank's
attention heads, and a rank's slice of a full checkpoint tensor.

With a group of size 1 every layer here is the plain layer (no collective runs, no
extra op). This module knows no architecture and no weight names (the model decides
what is sharded how), never reads files and never starts processes or groups."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl.kernels.fp8_linear import ALIGN, FP8, fp8_linear, quantize_rows
from sgl.kernels.lora import LoraBatch
from sgl.sched.models.lora_layers import LoraWeights
from sgl.sched.models.parallel import TPGroup


def local_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(q heads, kv heads) of one rank. KV heads are split when tp_size divides them and
    replicated when they divide tp_size (each is then held by tp_size / num_kv_heads ranks)."""
    if num_heads % tp.size:
        raise ValueError(f"num_attention_heads={num_heads} does not split over tp_size={tp.size}")
    if num_kv_heads % tp.size and tp.size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} and tp_size={tp.size}: one must divide the other "
            "(KV heads are split over the ranks or replicated across them)"
        )
    return num_heads // tp.size, max(1, num_kv_heads // tp.size)


def rank_slice(name: str, full: torch.Tensor, dim: int, n: int, lo: int, hi: int) -> torch.Tensor:
    """[lo, hi) of the full tensor `name` along `dim`, whose size there must be the full
    model's n; rows past n (the padding of a vocab, dim 0 only) are zeros."""
    if full.dim() <= dim or full.shape[dim] != n:
        raise ValueError(f"weight {name!r} has shape {tuple(full.shape)}, expected size {n} in dimension {dim}")
    start, stop = min(lo, n), min(hi, n)
    part = full.narrow(dim, start, stop - start)
    return F.pad(part, (0, 0, 0, hi - lo - (stop - start))) if hi > n else part


class Linear(nn.Module):
    """y = x W^T + b. With `reduce` (a group of size > 1) it is row-parallel: `in_features`
    is this rank's shard of the input, the partial products are summed over the ranks,
    and the bias (whole on every rank) is added once, after the sum. With `lora`, a
    forward given a LoraBatch adds each row's adapter delta (before the sum, so a
    row-parallel layer's delta is summed with it: no collective of its own). After
    `to_fp8` W is held in FP8 with a scale per output row (`weight_scale`), and values
    reach it through `load_rows`, which quantizes them."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        reduce: TPGroup | None = None,
        lora: LoraWeights | None = None,
    ):
        super().__init__()
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        self.lora = lora
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.dtype = dtype  # of its input and output, whatever W's
        self.register_buffer("weight_scale", None, persistent=False)  # [out_features] float32 once FP8

    def to_fp8(self) -> None:
        """Hold W in FP8 from now on (its values are lost: load them after). On a GPU both
        of W's dimensions must be multiples of 16 (FP8 GEMMs); ValueError otherwise."""
        n, k = self.weight.shape
        dev = self.weight.device
        if not self.fp8_fits():
            raise ValueError(f"quantization='fp8': a projection of shape ({n}, {k}) on this rank; FP8 GEMMs "
                             f"need both dimensions in multiples of {ALIGN}: leave quantization unset")
        self.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale = torch.ones(n, dtype=torch.float32, device=dev)

    def fp8_fits(self) -> bool:
        """Whether `to_fp8` takes W: anywhere but on a GPU, whose FP8 GEMMs need both of W's
        dimensions in multiples of 16."""
        n, k = self.weight.shape
        return self.weight.device.type != "cuda" or not (n % ALIGN or k % ALIGN)

    def load_rows(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """An FP8 W's rows [lo, hi) = values, quantized, with their rows' scales."""
        assert self.weight_scale is not None, "a weight not in FP8 is copied into as it is"
        q, scale = quantize_rows(values.to(self.weight.device))
        self.weight.data[lo:hi].copy_(q)
        self.weight_scale[lo:hi].copy_(scale.view(-1))

    def weight_values(self) -> torch.Tensor:
        """W in the layer's dtype (dequantized when FP8)."""
        if self.weight_scale is None:
            return self.weight.data
        return (self.weight.data.float() * self.weight_scale[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        bias = self.bias if self.reduce is None else None  # row-parallel: added once, after the sum
        if self.weight_scale is None:
            y = F.linear(x, self.weight, bias)
        else:
            y = fp8_linear(x, self.weight, self.weight_scale, self.dtype)
            if bias is not None:
                y = y + bias
        if lora is not None and self.lora is not None:
            self.lora.add_delta(x, y, lora)
        if self.reduce is None:
            return y
        y = self.reduce.all_reduce(y)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    """Vocab-parallel: this rank holds rows [lo, hi) of the vocab padded up to a multiple
    of tp_size (the padding rows are zero); ids of other ranks' rows embed to zero here
    and are filled in by the all-reduce."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype, device: torch.device, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.lo, self.hi = tp.split(-(-num // tp.size) * tp.size)
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.lo) & (ids < self.hi)
        h = F.embedding(torch.where(inside, ids - self.lo, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(~inside.unsqueeze(-1), 0.0))
