"""KV pool sizing and construction: how many KV slots there are (given, or a share
of the GPU memory the weights left free, or of host RAM on CPU), and the three
pools the scheduler and the model share: the KV tensors, the slot allocator and
the request-to-token table.

Plain numbers in, pools out: it knows no server arguments, no model and no
scheduling, and it decides nothing about who owns a slot."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sgl.cache.kv_allocator import TokenToKVPoolAllocator
from sgl.cache.kv_pool import MHATokenToKVPool
from sgl.cache.req_to_token_pool import ReqToTokenPool

DEFAULT_CPU_KV_TOKENS = 65536
DEFAULT_GPU_MEM_FRACTION = 0.8
CPU_RAM_SHARE = 0.2  # of physical RAM, for the KV pool on CPU (at most DEFAULT_CPU_KV_TOKENS)
DEFAULT_MAX_RUNNING_REQUESTS = 256


@dataclass(frozen=True, slots=True)
class KVPools:
    kv_pool: MHATokenToKVPool
    allocator: TokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool
    max_total_tokens: int  # KV slots
    max_running_requests: int  # request-to-token rows


def default_kv_tokens(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device, mem_fraction: float | None = None, extra_bytes_per_token: int = 0) -> int:
    """KV slots that fit: on CUDA `mem_fraction` (default DEFAULT_GPU_MEM_FRACTION) of the
    free memory, on CPU a share of the RAM, at most DEFAULT_CPU_KV_TOKENS. A second pool at
    the same slots (a draft model's) adds `extra_bytes_per_token`."""
    per_token = MHATokenToKVPool.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) + extra_bytes_per_token
    if device.type == "cuda":
        # SGLang's meaning: the KV pool takes this fraction of what the weights left free;
        # the rest holds activations, logits and CUDA graphs.
        free, _ = torch.cuda.mem_get_info(device)
        frac = mem_fraction or DEFAULT_GPU_MEM_FRACTION
        return max(1, int(free * frac) // per_token)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(DEFAULT_CPU_KV_TOKENS, int(ram * CPU_RAM_SHARE) // per_token))


def build_kv_pools(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                   context_length: int, max_total_tokens: int | None = None, max_running_requests: int | None = None,
                   mem_fraction: float | None = None) -> KVPools:
    """The pools for a model of these dimensions. Unset (None or 0) sizes default: the KV
    slots from memory (`default_kv_tokens`, measured now: call it once the weights are
    loaded), the rows to min(DEFAULT_MAX_RUNNING_REQUESTS, slots)."""
    total = max_total_tokens or default_kv_tokens(num_layers, num_kv_heads, head_dim, dtype, device, mem_fraction)
    running = max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, total)
    kv_pool = MHATokenToKVPool(total, num_layers, num_kv_heads, head_dim, dtype, device)
    # Slot bookkeeping lives on the host: the scheduler decides there. The forward
    # builds its KV indices on the device from the table's mirror, which each batch
    # brings up to date with the rows' changed ranges (one pinned copy, never a sync).
    allocator = TokenToKVPoolAllocator(total, "cpu")
    req_to_token_pool = ReqToTokenPool(running, context_length + 1, device)
    return KVPools(kv_pool, allocator, req_to_token_pool, total, running)
