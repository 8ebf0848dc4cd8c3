"""FlashInfer attention over the paged KV pool (GPU, bf16/fp16, page size 1).

- decode: paged decode over each request's KV slots;
- extend without any cached prefix: ragged prefill over the new tokens (causal);
- extend on a cached prefix: ragged prefill over the new tokens (causal) merged
  with paged prefill over the prefix (non-causal) by their log-sum-exp;
- cascade decode (a prefix shared by the whole batch): paged prefill of all B
  queries as one block over the shared slots (read once), paged decode over each
  request's suffix, merged by log-sum-exp (opt-in: `enable_cascade_attention`).
  Eager only: no CUDA graph is captured for it. Numerically checked on an H200,
  but W3 ran slower with it than without, not yet profiled (benchmarks/RESULTS.md).
Plans run on the host, once per batch, before the layers; under CUDA graphs one
decode wrapper per captured batch size owns fixed index buffers, and `plan` runs
before each replay, outside the graph. This module decides nothing about batching.

A plan must never wait for the GPU, or the overlap loop stalls: every host tensor
handed to `plan` (indptrs, last-page lengths, sequence lengths) is pinned, since
FlashInfer copies them to the device with non_blocking=True, which from pageable
memory synchronises the stream, and reads them on the host with `.to("cpu")`,
which for a device tensor synchronises too. (FlashInfer's eager decode plan still
copies a pageable range buffer of its own; only CUDA-graph decode is sync-free.)"""

from __future__ import annotations

import torch

from sgl.kernels.attention import AttentionBackend, AttnMetadata, CascadeMeta

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    supports_cascade = True

    def __init__(
        self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        max_kv_tokens: int,
    ) -> None:
        import flashinfer

        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend='flashinfer' needs dtype bfloat16 or float16, not {dtype}: "
                             "pass dtype='bfloat16' or attention_backend='torch'")
        self.fi = flashinfer
        self.hq, self.hkv, self.d, self.dtype, self.device = num_qo_heads, num_kv_heads, head_dim, dtype, device
        self.max_kv_tokens = max_kv_tokens
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor-core decode pays off once several query heads share a KV head.
        self.tensor_cores = num_qo_heads // num_kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores, backend="fa2")
        self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.graph_decode: dict[int, object] = {}
        self._mode = "decode"
        self._active_decode: object = self.decode
        self._ones = torch.ones(4096, dtype=torch.int32).pin_memory()
        # Each wrapper's plan writes its schedule into a pinned buffer and queues a copy
        # from it: the next plan may overwrite that buffer only once the copy has run.
        self._plan_copied: torch.cuda.Event | None = None

    # ---- planning --------------------------------------------------------------

    def _plan_decode(self, wrapper: object, kv_indptr_host: torch.Tensor, kv_indices: torch.Tensor) -> None:
        b = kv_indptr_host.numel() - 1
        wrapper.plan(  # type: ignore[attr-defined]
            kv_indptr_host, kv_indices, self._last_page_len(b), self.hq, self.hkv, self.d, 1,
            q_data_type=self.dtype, kv_data_type=self.dtype,
        )

    def _last_page_len(self, b: int) -> torch.Tensor:
        if b > self._ones.numel():
            self._ones = torch.ones(b, dtype=torch.int32).pin_memory()
        return self._ones[:b]

    def _before_plan(self) -> None:
        if self._plan_copied is not None:
            self._plan_copied.synchronize()  # in practice long done: it precedes the running batch

    def _after_plan(self) -> None:
        if self._plan_copied is None:
            self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    def begin_forward(self, meta: AttnMetadata) -> None:
        assert meta.kv_indptr_host is not None and meta.qo_indptr_host is not None
        self._before_plan()
        if meta.cascade is not None:
            self._plan_cascade(meta.cascade)
        elif meta.is_decode:
            self._mode = "decode"
            self._active_decode = self.decode
            self._plan_decode(self.decode, meta.kv_indptr_host, meta.kv_indices)
        else:
            self._plan_extend(meta)
        self._after_plan()

    def _plan_cascade(self, c: CascadeMeta) -> None:
        self._mode = "cascade"
        b = c.suffix_indptr_host.numel() - 1
        p = c.shared_len
        # All b queries form one non-causal block over the shared slots.
        self.paged.plan(torch.tensor([0, b], dtype=torch.int32).pin_memory(),
                        torch.tensor([0, p], dtype=torch.int32).pin_memory(), c.shared_indices,
                        self._last_page_len(1), self.hq, self.hkv, self.d, 1, causal=False,
                        q_data_type=self.dtype, kv_data_type=self.dtype,
                        seq_lens=torch.tensor([p], dtype=torch.int32).pin_memory())
        self._plan_decode(self.decode, c.suffix_indptr_host, c.suffix_indices)

    def _plan_extend(self, meta: AttnMetadata) -> None:
        qo = meta.qo_indptr_host
        assert qo is not None
        self.ragged.plan(qo, qo, self.hq, self.hkv, self.d, causal=True, q_data_type=self.dtype,
                         kv_data_type=self.dtype)
        if meta.prefix_indptr_host is None:
            self._mode = "extend"
            return
        self._mode = "extend_prefix"
        b = qo.numel() - 1
        self.paged.plan(qo, meta.prefix_indptr_host, meta.prefix_indices, self._last_page_len(b), self.hq,
                        self.hkv, self.d, 1, causal=False, q_data_type=self.dtype, kv_data_type=self.dtype,
                        seq_lens=meta.prefix_lens_host)

    # ---- CUDA graphs -------------------------------------------------------------

    def init_graph_decode(self, bs: int) -> None:
        """A decode wrapper with fixed buffers for batch size `bs` (before capture)."""
        w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(self.max_kv_tokens + bs, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=self.device),
            backend="fa2",
        )
        self.graph_decode[bs] = w
        # A valid plan for capture: every row attends to the padding slot alone.
        self.begin_graph_decode(bs, torch.arange(bs + 1, dtype=torch.int32).pin_memory(),
                                torch.zeros(bs, dtype=torch.int64, device=self.device))

    def begin_graph_decode(self, bs: int, kv_indptr_host: torch.Tensor, kv_indices: torch.Tensor) -> None:
        w = self.graph_decode[bs]
        self._mode = "decode"
        self._active_decode = w
        self._before_plan()
        self._plan_decode(w, kv_indptr_host, kv_indices)
        self._after_plan()

    # ---- the layer call ----------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        kv = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [slots, page=1, Hkv, D]
        if self._mode == "decode":
            return self._active_decode.run(q, kv)  # type: ignore[attr-defined]
        if self._mode == "extend":
            return self.ragged.run(q, k, v)
        if self._mode == "cascade":
            o_shared, lse_shared = self.paged.run(q, kv, return_lse=True)
            o_own, lse_own = self.decode.run(q, kv, return_lse=True)
            return self.fi.merge_state(o_shared, lse_shared, o_own, lse_own)[0]
        o_new, lse_new = self.ragged.run(q, k, v, return_lse=True)
        o_pre, lse_pre = self.paged.run(q, kv, return_lse=True)
        o, _ = self.fi.merge_state(o_new, lse_new, o_pre, lse_pre)
        return o
