"""The request-to-token table: one row per running request, holding the KV slot
index of each of its tokens. It owns rows, never KV slots."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A [size, max_context] int32 table; `alloc` hands out free rows."""

    def __init__(self, size: int, max_context: int, device: str | torch.device = "cpu") -> None:
        if size < 1 or max_context < 1:
            raise ValueError(f"ReqToTokenPool needs size >= 1 and max_context >= 1, got {size}, {max_context}")
        self.size = size
        self.max_context = max_context
        self.req_to_token = torch.zeros((size, max_context), dtype=torch.int32, device=device)
        self._free: list[int] = list(range(size - 1, -1, -1))  # pop() hands out row 0 first

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"row {row} out of range [0, {self.size})")
        self._free.append(row)

    def clear(self) -> None:
        self._free = list(range(self.size - 1, -1, -1))
