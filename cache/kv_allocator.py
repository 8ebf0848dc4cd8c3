"""The token-to-KV slot allocator: which KV slots are free. Page size 1; slot 0 is
the padding slot and is never handed out, so `size` usable slots are 1..size.
It tracks slots only; the tensors live in the KV pool.

Every slot carries a state, 1 free and 0 held, checked on each alloc and free: a
slot freed twice, one never handed out, or the padding slot is refused at once
with an error (always on, O(1) per slot), never handed out to two owners."""

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
        self._state = torch.ones(self.size + 1, dtype=torch.int32)  # per slot: 1 free, 0 held
        self._state[0] = 0  # the padding slot is never free

    def available_size(self) -> int:
        return self._n_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots (int64, on the pool's device), or None when fewer are free."""
        if n > self._n_free:
            return None
        out = self._free[self._n_free - n : self._n_free]
        self._n_free -= n
        self._state[out] = 0
        return out.to(self.device, copy=True)

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        s = slots.reshape(-1).to("cpu", torch.int64)
        if self._n_free + n > self.size or int(s.min()) < 1 or int(s.max()) > self.size:
            raise RuntimeError(f"KV double free or bad slot: freeing {n} slots in [{int(s.min())}, {int(s.max())}] "
                               f"with {self._n_free} of {self.size} (slots 1..{self.size}) already free")
        # Counting each freed slot onto its state catches a free slot and a slot twice in `s` alike.
        self._state.index_put_((s,), torch.ones_like(s, dtype=torch.int32), accumulate=True)
        if int(self._state[s].max()) > 1:
            self._state.index_put_((s,), torch.full_like(s, -1, dtype=torch.int32), accumulate=True)
            raise RuntimeError(f"KV double free: of {n} slots freed, some were already free or appear twice")
        self._free[self._n_free : self._n_free + n] = s
        self._n_free += n

    def free_slots(self) -> torch.Tensor:
        """A copy of the free slot ids (for invariant checks; not for hot paths)."""
        return self._free[: self._n_free].clone()
