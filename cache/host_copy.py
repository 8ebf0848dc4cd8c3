"""Host tensors headed for a device, moved without ever waiting for it.

On CUDA a host tensor is pinned and copied with non_blocking=True: a copy from
pageable memory would synchronise the stream, and the overlap loop builds batch
N+1 while batch N still runs. Elsewhere the tensor is moved as usual (on CPU it
is used as it is). A bottom module: it holds no state and imports nothing of sgl."""

from __future__ import annotations

import torch


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` as a host tensor that `device` may copy from asynchronously."""
    return t.pin_memory() if device.type == "cuda" else t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; on CUDA the copy is queued and the caller goes on at once."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
