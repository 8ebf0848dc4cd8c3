"""The LoRA side of a projection: each adapter slot's matrices for one (possibly fused)
linear layer, and the delta they add to its output.

A projection fusing several of Hugging Face's (q/k/v, gate/up) keeps one A per part,
stacked, and one B per part at that part's output rows (`sgl.kernels.lora`'s layout).
Ranks below the slots' rank are zero-padded; the adapter's scaling is in B already
(sgl.sched.models.lora_adapter). Slots are filled between forwards by the LoRA manager
through the model's `load_lora`, in the order the device runs work; an empty slot is
all zeros.

This module never reads files, never decides which adapter sits in which slot and
never runs without a LoraBatch (a forward with none adds nothing)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sgl.core.server_args import ServerArgs
from sgl.kernels.lora import LoraBatch, lora_apply
from sgl.sched.models.lora_adapter import TARGETS, LoraAdapter

DEFAULT_MAX_RANK = 16  # vLLM's default max_lora_rank


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """The device pool every LoRA projection of a model holds: `slots` adapters of rank
    up to `rank`, changing only the projections in `targets` (Hugging Face names)."""

    slots: int
    rank: int
    targets: frozenset[str]

    @classmethod
    def from_args(cls, args: ServerArgs) -> LoraSpec:
        """The pool an engine's args ask for: max_loras_per_batch slots; max_lora_rank, else the
        largest rank of the adapters loaded at start, else DEFAULT_MAX_RANK; the projections of
        lora_target_modules (all when empty or "all")."""
        rank = args.max_lora_rank
        if rank is None:
            ranks = [LoraAdapter.declared_rank(p) for p in args.lora_adapters.values()]
            rank = max([r for r in ranks if r > 0], default=DEFAULT_MAX_RANK)
        given = set(args.lora_target_modules)
        targets = frozenset(TARGETS) if not given or "all" in given else frozenset(given)
        return cls(args.max_loras_per_batch, rank, targets)

    @classmethod
    def none(cls) -> LoraSpec:
        """A model without LoRA slots."""
        return cls(0, 0, frozenset())

    def weights(self, parts: tuple[str, ...], in_features: int, sizes: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> LoraWeights | None:
        """The matrices of a projection fusing `parts` (output sizes `sizes`), or None when
        no adapter may change any of its parts."""
        if not self.targets.intersection(parts):
            return None
        return LoraWeights(self.slots, self.rank, in_features, sizes, dtype, device)


class LoraWeights(nn.Module):
    a: torch.Tensor  # [slots, parts * rank, in_features]
    b: torch.Tensor  # [slots, out_features, rank]

    def __init__(self, slots: int, rank: int, in_features: int, sizes: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.rank = rank
        self.sizes = sizes
        self.offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        # Buffers, not parameters: weight updates, reads and memory release see the base model only.
        self.register_buffer("a", torch.zeros(slots, len(sizes) * rank, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(slots, sum(sizes), rank, dtype=dtype, device=device), persistent=False)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part`'s A [r, in] and B [size, r] (this rank's shard) into `slot`."""
        r = a.shape[0]
        lo = self.offsets[part]
        self.a[slot, part * self.rank : part * self.rank + r].copy_(a, non_blocking=True)
        self.b[slot, lo : lo + self.sizes[part], :r].copy_(b, non_blocking=True)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> None:
        """y += each row's adapter delta (rows of no adapter unchanged)."""
        lora_apply(x, y, self.a, self.b, self.sizes, batch)
