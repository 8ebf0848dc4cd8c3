"""The attention backend interface and the metadata every backend is fed.

A batch is described as FlashInfer describes it: request i has queries
q[qo_indptr[i]:qo_indptr[i+1]] and attends to the KV slots
kv_indices[kv_indptr[i]:kv_indptr[i+1]] (its cached prefix followed by its new
tokens, whose K/V were written to the pool before attention runs). The last
query of a request sits at the last KV position; attention is causal.

A decode batch whose requests all start with the same KV slots (a shared system
prompt held once by the radix cache) may instead carry a `CascadeMeta`: the
shared slots once, and each request's own suffix. A backend that plans cascades
reads the shared prefix once per step for the whole batch rather than once per
request; only backends with `supports_cascade` are handed one, and by default
(`enable_cascade_attention=None`) only those whose cascade saves reads
(`cascade_by_default`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class CascadeMeta:
    shared_len: int  # P: request i's slots [0, P) are the same for every request
    shared_indices: torch.Tensor  # [P] int32 KV slot ids, on the model's device
    suffix_indptr_host: torch.Tensor  # [B + 1] int32, pinned: request i's slots from P on
    suffix_indices: torch.Tensor  # [suffix_indptr[-1]] int32
    # Names the shared slots: equal keys mean equal shared_indices (the batch's requests,
    # rows and retraction epochs, and P), so a backend may keep its plan of the shared
    # block from the last step. Empty: no such promise.
    key: tuple = ()


@dataclass(slots=True)
class AttnMetadata:
    is_decode: bool
    qo_indptr: torch.Tensor  # [B + 1] int32, on the model's device
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32 KV slot ids (empty when `cascade` is set)
    qo_lens: list[int]  # host copies, for backends that plan on the host
    kv_lens: list[int]
    # [B + 1] int32 on the host, pinned on CUDA (FlashInfer plans there and copies them
    # to the device asynchronously; from pageable memory that copy would sync).
    kv_indptr_host: torch.Tensor | None = None
    qo_indptr_host: torch.Tensor | None = None
    # The cached prefix alone (kv minus the new tokens), for a backend that attends to it
    # apart from the new tokens (AttentionBackend.reads_prefixes_apart); None otherwise,
    # and when no extend row of the batch has a prefix.
    prefix_indptr_host: torch.Tensor | None = None
    prefix_indices: torch.Tensor | None = None
    prefix_lens_host: torch.Tensor | None = None  # [B] int32
    # A decode batch's split over its shared slots, or a mixed batch's decode rows' (their
    # kv_indices are then there too, as every other row's).
    cascade: CascadeMeta | None = None
    # Decode only: KV slots every row begins with (0 where none, or where nobody looked);
    # a backend may pick its kernel by it.
    shared_len: int = 0
    # A mixed batch (an extend that also steps running requests): its rows from this one on
    # are decode rows, one query each over its first kv_lens slots, which a backend may run
    # through its decode kernel; the prefix fields describe the rows before it alone.
    decode_from: int | None = None


class AttentionBackend(ABC):
    supports_cascade = False
    cascade_by_default = False

    @abstractmethod
    def begin_forward(self, meta: AttnMetadata) -> None:
        """Prepare for one forward pass (once per batch, not per layer)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: the new tokens' [T, Hkv, D], already written to the pool;
        k_cache, v_cache: the layer's pool [slots, Hkv, D]. Returns [T, Hq, D]."""

    def reads_prefixes_apart(self, query_tokens: int) -> bool:
        """Whether an extend of `query_tokens` query tokens in all (decode rows included)
        attends to its rows' cached prefixes apart from their new tokens, and so needs
        AttnMetadata's prefix fields (a gather of their slots on the device)."""
        return False

    # Whole extend graphs (sgl.sched.runner.prefill_graph): a backend whose extend attention
    # can be captured plans each batch into one graph-mode wrapper's buffers.
    supports_extend_graphs = False

    def init_extend_graph(self, max_tokens: int, max_reqs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not run under CUDA graphs")

    def takes_extend_graph(self, meta: AttnMetadata) -> bool:
        """Whether this batch's attention runs in a whole extend graph (as planned by
        begin_graph_extend) rather than eagerly between the pieces."""
        return False

    def begin_graph_extend(self, qo_indptr_host: torch.Tensor, kv_indptr_host: torch.Tensor,
                           kv_indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not run under CUDA graphs")

    # CUDA-graph decode: backends that can be captured plan each padded batch size into
    # buffers that a graph replays. The torch reference is never captured.
    # A backend with a second decode kernel ("tensor cores") captures each size with the
    # kernels decode_kernels(bs) names, and picks one per batch.
    def decode_kernels(self, bs: int) -> tuple[bool, ...]:
        return (False,)

    def picks_tensor_cores(self, bs: int, kv_indptr_host: torch.Tensor, shared_len: int) -> bool:
        return False

    def begin_graph_decode(self, bs: int, kv_indptr_host: torch.Tensor, kv_indices: torch.Tensor,
                           tensor_cores: bool) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not run under CUDA graphs")

    def begin_graph_cascade(self, bs: int, shared_len: int, shared_indices: torch.Tensor,
                            suffix_indptr_host: torch.Tensor, suffix_indices: torch.Tensor, key: tuple = ()) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not run under CUDA graphs")
