"""ForwardBatch: everything one model forward needs, built by the model runner.
Tokens of all requests are packed: request i owns rows
attn.qo_indptr[i]:attn.qo_indptr[i+1]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sgl.cache.kv_pool import MHATokenToKVPool
from sgl.kernels.attention import AttentionBackend, AttnMetadata


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slot of each new token
    # [R] int64: the packed rows whose logits are wanted (each request's last, and prompt-logprob rows)
    logits_indices: torch.Tensor
    attn: AttnMetadata
    attn_backend: AttentionBackend
    kv_pool: MHATokenToKVPool



class CausalLM(Protocol):
    """What the model runner needs of a model: its shape, and a forward from a
    ForwardBatch to the logits rows it asks for."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __call__(self, fb: ForwardBatch) -> torch.Tensor: ...
