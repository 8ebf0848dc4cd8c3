"""LoRA deltas for a packed batch whose rows use different adapters (placeholder: torch path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_M = 16


@dataclass(slots=True)
class LoraBatch:
    block_start: torch.Tensor
    block_len: torch.Tensor
    block_slot: torch.Tensor
    groups: list[tuple[int, torch.Tensor]]
    triton: bool

    @classmethod
    def from_runs(cls, slots: list[int], lens: list[int], device: torch.device, triton: bool) -> LoraBatch:
        rows: dict[int, list[int]] = {}
        at = 0
        for s, n in zip(slots, lens):
            if s >= 0:
                rows.setdefault(s, []).extend(range(at, at + n))
            at += n
        groups = [(s, torch.tensor(r, dtype=torch.int64, device=device)) for s, r in rows.items()]
        e = torch.empty(0, dtype=torch.int32, device=device)
        return cls(e, e, e, groups, False)

    @staticmethod
    def max_blocks(num_rows: int, num_requests: int) -> int:
        return num_requests + -(-num_rows // BLOCK_M)

    @classmethod
    def empty(cls, n: int, device: torch.device) -> LoraBatch:
        z = torch.zeros(n, dtype=torch.int32, device=device)
        return cls(z, z.clone(), z.clone(), [], True)

    def view(self, n: int) -> LoraBatch:
        return LoraBatch(self.block_start[:n], self.block_len[:n], self.block_slot[:n], [], self.triton)

    def copy_into(self, dst: LoraBatch) -> None:
        raise NotImplementedError


def available(device: torch.device) -> bool:
    return False


def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               sub_sizes: tuple[int, ...], batch: LoraBatch) -> None:
    r = a.shape[1] // len(sub_sizes)
    for slot, rows in batch.groups:
        inter = x[rows] @ a[slot].T
        parts = []
        off = 0
        for j, n in enumerate(sub_sizes):
            parts.append(inter[:, j * r:(j + 1) * r] @ b[slot, off:off + n].T)
            off += n
        y.index_add_(0, rows, torch.cat(parts, dim=1))
