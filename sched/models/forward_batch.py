"""ForwardBatch: everything one model forward needs, built by the model runner.
Tokens of all requests are packed: request i owns rows
attn.qo_indptr[i]:attn.qo_indptr[i+1]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sgl.cache.kv_pool import MHATokenToKVPool
from sgl.kernels.attention import AttentionBackend, AttnMetadata
from sgl.kernels.lora import LoraBatch
from sgl.sched.models.lora_layers import LoraSpec


@dataclass(slots=True)
class PoolRows:
    """The packed rows of a prefill whose final hidden states embedding requests pool, each
    entry's rows one run (a mean-pooled chunk's every row, a last-token request's last row).
    The forward fills `out` [count, hidden] float32: each entry's sum."""

    rows: torch.Tensor  # [N] int64
    last: torch.Tensor  # [count] int64: the index in `rows` of each entry's last row, increasing
    out: torch.Tensor | None = None

    def pool(self, hidden: torch.Tensor) -> None:
        """Sum `hidden` ([N, H]: the final-norm states of `rows`) into `out`, per entry: the
        differences of one running sum in float64 at the entries' ends. The same on every run,
        where index_add_ adds with atomics on a GPU, in an order that varies by an ulp."""
        ends = hidden.cumsum(0, dtype=torch.float64)[self.last]
        self.out = torch.diff(ends, dim=0, prepend=ends.new_zeros((1, ends.shape[1]))).float()


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
    pool: PoolRows | None = None  # embedding requests' rows (prefill only)
    lora: LoraBatch | None = None  # each row's LoRA adapter slot; None: no adapters in this engine


class CausalLM(Protocol):
    """What the model runner needs of a model: its shape, and a forward from a
    ForwardBatch to the logits rows it asks for."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __call__(self, fb: ForwardBatch) -> torch.Tensor: ...


class ModelOnDevice(Protocol):
    """A model with what its forwards run on (the target's model runner, or a speculative
    draft model): what the CUDA graphs capture and replay (sgl.sched.runner.cuda_graph,
    sgl.sched.runner.prefill_graph)."""

    model: CausalLM
    kv_pool: MHATokenToKVPool
    attn_backend: AttentionBackend
    device: torch.device
    dtype: torch.dtype
    cascade: bool  # decode graphs for cascade attention too
    lora_spec: LoraSpec | None  # adapters' buffers in the decode graphs
