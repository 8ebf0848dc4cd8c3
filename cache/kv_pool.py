"""The KV pool: per layer, one K and one V tensor of [size + 1, kv_heads, head_dim],
indexed by KV slot (slot 0 is padding). Its memory can be released and allocated again
(`release`, `resume`), which loses the KV it held. It stores; it never decides who owns
a slot."""

from __future__ import annotations

import torch

from sgl.cache.kv_write import write_kv


class MHATokenToKVPool:
    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_buffer, self.v_buffer = self._allocate()
        self.released = False

    def _allocate(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (self.size + 1, self.num_kv_heads, self.head_dim)
        layers = range(self.num_layers)
        return [self._buffer(shape) for _ in layers], [self._buffer(shape) for _ in layers]

    def _buffer(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """One layer's K or V. Slot 0 (padding: read under a zero attention weight) must be
        finite, so it is zeroed; every other slot is written before any read. On the CPU the
        rest is left as the allocator gives it: filling gigabytes with zeros page by page took
        most of an engine's start there."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        out[0].zero_()
        return out

    def release(self) -> None:
        """Free the K/V tensors (each layer keeps an empty one); their KV is lost."""
        if self.released:
            raise ValueError("the KV cache is released already")
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.k_buffer = [empty] * self.num_layers
        self.v_buffer = [empty] * self.num_layers
        self.released = True

    def resume(self) -> None:
        """Allocate the K/V tensors again (new storage: what they held is gone); on failure (out of memory)
        the pool stays released."""
        if not self.released:
            raise ValueError("the KV cache is not released")
        self.k_buffer, self.v_buffer = self._allocate()
        self.released = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_buffer, *self.v_buffer))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v of shape [n, kv_heads, head_dim] at slots `loc` ([n])."""
        write_kv(self.k_buffer[layer], self.v_buffer[layer], loc, k, v)
