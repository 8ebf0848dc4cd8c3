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
    row-parallel layer's delta is summed with it: no collective of its own)."""

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

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if self.reduce is None:
            y = F.linear(x, self.weight, self.bias)
            if lora is not None and self.lora is not None:
                self.lora.add_delta(x, y, lora)
            return y
        y = F.linear(x, self.weight)
        if lora is not None and self.lora is not None:
            self.lora.add_delta(x, y, lora)
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
