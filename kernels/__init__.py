"""Compute kernels: attention backends and the small layers (norm, rotary,
activation), the multi-LoRA GEMMs. One dispatch point per op picks CPU (pure torch) or GPU code.
Imports nothing of the rest of sgl."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.cache
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(device: torch.device) -> bool:
    """Whether sgl's Triton kernels run on `device`: a CUDA device, Triton installed (elsewhere
    each op takes its pure-torch path; tests run the kernels under Triton's interpreter)."""
    return device.type == "cuda" and triton_installed()
