"""Host tensors headed for a device, and device tensors for the host, moved without
ever waiting for it.

On CUDA a host tensor is pinned and copied with non_blocking=True: a copy from
pageable memory would synchronise the stream, and the overlap loop builds batch
N+1 while batch N still runs. Elsewhere the tensor is moved as usual (on CPU it
is used as it is). `Uploads` moves several small host tensors in one copy per dtype: on a
GPU host each copy costs far more than its bytes (a pinned block, a driver call), and a
decode step's ten small copies took about a tenth of its host time. A bottom module: it
imports nothing of sgl."""

from __future__ import annotations

import torch


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` as a host tensor that `device` may copy from asynchronously."""
    return t.pin_memory() if device.type == "cuda" else t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from the host to CUDA the copy is queued and the caller goes on at
    once. A tensor already on a GPU stays where it is if that is `device` (compare device
    types, not devices: `cuda` and `cuda:0` are one device yet unequal torch.devices)."""
    if device.type == "cuda" and t.device.type == "cpu":
        # Contiguous first: a strided pinned tensor's copy goes through a pageable temporary, and waits.
        return t.contiguous().pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_host(t: torch.Tensor, non_blocking: bool = True) -> torch.Tensor:
    """`t` on the host. From CUDA with non_blocking the copy is queued into pinned memory
    and is valid once the device has passed it (the caller waits on a later event)."""
    if t.device.type == "cpu":
        return t
    if not non_blocking:
        return t.cpu()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class Uploads:
    """Small host tensors bound for one device, moved in one copy per dtype: `add` each
    (its place comes back), `send` once, then `get` each one's device tensor, a view of
    its dtype's one copy. On CPU the tensors are only joined and split again (the one
    tensor of its dtype is used as it is, as `to_device` does)."""

    __slots__ = ("device", "_parts", "_places", "_out")

    ALIGN_BYTES = 16  # each tensor starts this aligned, as a tensor of its own would (Triton specialises on it)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: dict[torch.dtype, list[torch.Tensor]] = {}  # per dtype: the tensors, flat, and their padding
        self._places: list[tuple[torch.dtype, int, torch.Size]] = []
        self._out: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}

    def add(self, t: torch.Tensor) -> int:
        parts = self._parts.setdefault(t.dtype, [])
        self._places.append((t.dtype, len(parts), t.shape))
        parts.append(t.reshape(-1))
        step = max(1, self.ALIGN_BYTES // t.element_size())
        if t.numel() % step:
            parts.append(t.new_zeros(step - t.numel() % step))  # the next tensor starts aligned
        return len(self._places) - 1

    def send(self) -> None:
        for dtype, parts in self._parts.items():
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]
            self._out[dtype] = to_device(flat, self.device).split([p.numel() for p in parts])

    def get(self, place: int) -> torch.Tensor:
        dtype, k, shape = self._places[place]
        return self._out[dtype][k].view(shape)
