"""The token-to-KV slot allocator: which KV slots are free. Page size 1; slot 0 is
the padding slot and is never handed out, so `size` usable slots are 1..size.
It tracks slots only; the tensors live in the KV pool."""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    def __init__(self, size: int, device: str | torch.device = "cpu") -> None:
        if size < 1:
            raise ValueError(f"the KV allocator needs at least one slot, got size={size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        # Kept on the host: the scheduler decides on the host, and on CPU it is the same memory.
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._n_free = self.size

    def available_size(self) -> int:
        return self._n_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots (int64, on the pool's device), or None when fewer are free."""
        if n > self._n_free:
            return None
        out = self._free[self._n_free - n : self._n_free]
        self._n_free -= n
        return out.to(self.device, copy=True)

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        if self._n_free + n > self.size:
            raise RuntimeError(f"double free: freeing {n} slots with {self._n_free} of {self.size} already free")
        self._free[self._n_free : self._n_free + n] = slots.reshape(-1).to("cpu", torch.int64)
        self._n_free += n

    def free_slots(self) -> torch.Tensor:
        """A copy of the free slot ids (for invariant checks; not for hot paths)."""
        return self._free[: self._n_free].clone()
