"""FlashInfer attention over the paged KV pool (GPU, bf16/fp16, page size 1).

- decode: paged decode over each request's KV slots;
- extend without any cached prefix: ragged prefill over the new tokens (causal);
- extend on a cached prefix: up to `paged_extend_max_tokens` tokens in the batch,
  one causal paged prefill over each request's whole KV (its new tokens' K/V are in the
  pool already); past that, ragged prefill over the new tokens (causal) merged with
  paged prefill over the prefix (non-causal) by their log-sum-exp. Between the pieces
  of a prefill's CUDA graphs attention runs eagerly, so each layer's call is the host's:
  one call where the split takes three (two runs and the merge), for a chat's short
  turn over a long cached system prompt;
- cascade decode (a prefix shared by the whole batch): paged prefill of all B
  queries as one block over the shared slots (read once), paged decode over each
  request's suffix, merged by log-sum-exp (on unless `enable_cascade_attention=False`);
- mixed (an extend whose forward also steps running requests): up to
  `paged_extend_max_tokens` tokens and no prefix shared by the decode rows, one causal
  paged prefill over every row's whole KV, a decode row being one query: one call a
  layer (with 16 running requests of 2,000 tokens, a 40-token chunk's forward took
  5.0 ms where the split took 9.1 and a decode step alone 3.4, on an H100). Else the
  extend rows as above and the decode rows through the decode kernel, or as a cascade
  when they share enough (as a decode step of theirs would; their suffixes, short, one
  query a row through paged prefill, whose plan never waits).
Plans run on the host, once per batch, before the layers. Under CUDA graphs each
captured batch size has its own decode wrapper (and, with cascade, its own
shared-block prefill wrapper) in graph mode, reading index buffers that all sizes
share (one graph replays at a time, and plans copy into them in stream order);
`plan` runs before each replay, outside the graph. Whole extend graphs (small
prefix-cached extends, sgl.sched.runner.prefill_graph) share one graph-mode paged prefill
wrapper, planned the same way (takes_extend_graph). Those index buffers are sized
for the worst case of the largest captured batch, max_bs x context_length slots,
since a decode batch's summed KV lengths count a prefix shared by many requests
once per request and so can far exceed the pool; the shared block's buffer holds
one prefix, at most min(context_length, pool) slots. Eager plans have no fixed
buffer (FlashInfer keeps the tensors it is handed). This module decides nothing
about batching.

A plan must never wait for the GPU, or the overlap loop stalls: every host tensor
handed to `plan` (indptrs, last-page lengths, sequence lengths) is pinned, since
FlashInfer copies them to the device with non_blocking=True, which from pageable
memory synchronises the stream, and reads them on the host with `.to("cpu")`,
which for a device tensor synchronises too. (FlashInfer's eager decode plan still
copies a pageable range buffer of its own; only CUDA-graph decode is sync-free.)

Two decode kernels: FlashInfer's decode kernel, and its prefill kernel run as decode
("tensor cores"), which packs a KV head's query heads into one tile and splits long
rows into balanced chunks. Where four or more query heads share a KV head the second
always runs. Otherwise (Qwen3-0.6B: 16 query / 8 KV heads), batches of at least
`tensor_core_min_batch` rows pick per batch (`prefers_tensor_cores`), and each such
graph size is captured with both kernels. Measured on an H200 (benchmarks/RESULTS.md,
2026-12-02): the tensor-core kernel is 3-10% faster on W2's mixed contexts from 62
rows on and 10% slower at 26 rows; 3-11% slower on W1's uniform rows (W1 end to end
7% slower with it); W3 without cascade (2,000 of each row's 2,100-2,228 slots shared)
24% faster end to end with it. A cascade's suffix decode keeps the decode kernel: its
short uniform suffixes read 1.4x faster with it.

With `triton_decode` (the engine's default where Triton is installed), plain decode runs
sgl's Triton kernel instead (sgl.kernels.triton_decode): one kernel at every batch size,
as fast as the faster of FlashInfer's two on bf16 pools and faster on FP8 ones, and no
plan on the host (FlashInfer's decode plans took 100-400 us of the scheduler's thread
a step on an H200 host). Its graphs read the batch's indptr from a buffer per size
and its indices from the shared index buffer, both written in stream order before the
replay. Prefill and cascade decode stay FlashInfer's."""

from __future__ import annotations

import torch

from sgl.kernels.attention import AttentionBackend, AttnMetadata, CascadeMeta
from sgl.kernels.triton_decode import decode_attention as triton_decode_attention

WORKSPACE_BYTES = 256 * 1024 * 1024
TENSOR_CORE_MIN_BATCH = 48
# Query tokens in an extend batch with cached prefixes, or in a mixed batch, up to which
# one paged prefill over each row's whole KV runs instead of ragged + paged + merge (and
# the decode kernel for a mixed batch's decode rows). Measured on an H100 (RESULTS.md,
# 2026-12-05, `python -m benchmarks.prefill_cost --prefix 1000 --paged-extend-max N`):
# the one call saves host time at every size (between the prefill graph's pieces each
# call is launched from Python) and the split's kernels GPU time past about a thousand
# tokens (its ragged prefill runs FlashInfer's Hopper kernel; the paged one fa2).
PAGED_EXTEND_MAX_TOKENS = 1024


class _HostLens(torch.Tensor):
    """The KV lengths handed to a tensor-core decode plan. FlashInfer 0.6.5 takes their
    maximum with Python's `max()`, a loop over 0-d tensors (about 1 ms at 256 rows, on
    the scheduler's thread every step) whose value the fa2 kernel never reads; iterating
    this tensor yields its maximum alone, computed in one op."""

    def __iter__(self):
        yield self.max()


def _host_lens(indptr: torch.Tensor) -> torch.Tensor:
    """Page size 1: a row's KV length is its indptr step."""
    return (indptr[1:] - indptr[:-1]).as_subclass(_HostLens)


def prefers_tensor_cores(kv_indptr_host: torch.Tensor, shared_len: int) -> bool:
    """Whether a decode batch (its KV indptr on the host; `shared_len` slots that every
    row begins with) reads faster through the tensor-core kernel: rows of mixed lengths
    (the longest over 1.25x the mean), or a shared prefix of at least half the mean row."""
    b = kv_indptr_host.numel() - 1
    total = int(kv_indptr_host[-1])
    longest = int((kv_indptr_host[1:] - kv_indptr_host[:-1]).max())
    return 4 * b * longest > 5 * total or 2 * b * shared_len >= total


class FlashInferAttentionBackend(AttentionBackend):
    supports_cascade = True
    cascade_by_default = True
    supports_extend_graphs = True

    def __init__(
        self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        max_kv_tokens: int, context_length: int | None = None, tensor_core_min_batch: int = TENSOR_CORE_MIN_BATCH,
        kv_dtype: torch.dtype | None = None, triton_decode: bool = False,
        paged_extend_max_tokens: int = PAGED_EXTEND_MAX_TOKENS,
    ) -> None:
        """max_kv_tokens: KV slots in the pool (slot 0 included); context_length: the most
        slots one request reads (None: max_kv_tokens); tensor_core_min_batch: decode
        batches of at least this many rows may run the tensor-core kernel; kv_dtype: the
        pool's element type (None: dtype; FP8 pools are read unscaled); triton_decode:
        plain decode through sgl's Triton kernel (see the module's docstring);
        paged_extend_max_tokens: see PAGED_EXTEND_MAX_TOKENS."""
        import flashinfer

        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend='flashinfer' needs dtype bfloat16 or float16, not {dtype}: "
                             "pass dtype='bfloat16' or attention_backend='torch'")
        self.fi = flashinfer
        self.hq, self.hkv, self.d, self.dtype, self.device = num_qo_heads, num_kv_heads, head_dim, dtype, device
        self.kv_dtype = kv_dtype or dtype
        self.max_kv_tokens = max_kv_tokens
        self.context_length = context_length or max_kv_tokens
        self.graph_max_bs = 0  # the batch size the graph index buffers were sized for
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor-core decode always pays off once four query heads share a KV head;
        # below that, only for some large batches (decode_kernels, picks_tensor_cores).
        self.tensor_cores = num_qo_heads // num_kv_heads >= 4
        self.tensor_core_min_batch = tensor_core_min_batch
        self.triton_decode = triton_decode
        self.paged_extend_max_tokens = paged_extend_max_tokens
        self._graph_indptr: dict[int, torch.Tensor] = {}  # triton: batch size -> its graph's indptr buffer
        self._triton_args: tuple[torch.Tensor, torch.Tensor] | None = None  # triton: (kv_indptr, kv_indices)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores, backend="fa2")
        self._decode_tc: object | None = None  # the eager tensor-core wrapper, made when first needed
        self.graph_decode: dict[tuple[int, bool], object] = {}  # (batch size, tensor cores) -> its wrapper
        self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.graph_shared: dict[int, object] = {}
        self._shared_planned: dict[int, tuple] = {}  # bs -> CascadeMeta.key its shared-block wrapper holds
        # The key whose shared slots the graphs' one shared-index buffer holds: every size's
        # shared-block wrapper reads that buffer, so another size's plan overwrites it.
        self._shared_indices_key: tuple = ()
        self._graph_indices: tuple[torch.Tensor, torch.Tensor] | None = None  # decode's, the shared block's
        # Whole extend graphs' one paged prefill wrapper (init_extend_graph), and the most
        # requests it plans: fewer are padded with empty ones.
        self.graph_extend: object | None = None
        self.graph_extend_reqs = 0
        self._mode = "decode"
        self._active_decode: object = self.decode
        self._active_shared: object = self.paged
        self._active_paged: object = self.paged  # an extend's paged prefill: eager, or the graphs'
        self._ones = torch.ones(4096, dtype=torch.int32).pin_memory()
        # The shared block's plan inputs ([0, B], [0, P], [P]), rewritten in place per plan.
        self._shared_qo = torch.zeros(2, dtype=torch.int32).pin_memory()
        self._shared_kv = torch.zeros(2, dtype=torch.int32).pin_memory()
        self._shared_len = torch.zeros(1, dtype=torch.int32).pin_memory()
        # Each wrapper's plan writes its schedule into a pinned buffer and queues a copy
        # from it: the next plan may overwrite that buffer only once the copy has run.
        self._plan_copied: torch.cuda.Event | None = None
        # How an extend's rows attend: "ragged" (no cached prefix), "paged" (one call over
        # their whole KV) or "split" (ragged + paged over the prefix, merged).
        self._extend_kind = "ragged"
        self._extend_tokens = 0  # a mixed batch's extend rows' query tokens
        # A mixed batch's cascade: its shared block's wrapper and its suffixes' (one query a
        # row, through paged prefill: its plan, unlike the eager decode plan, copies nothing
        # from pageable memory), made when first needed.
        self._mixed_shared: object | None = None
        self._mixed_suffix: object | None = None
        self._mixed_cascade = False
        # Pinned int32 inputs that plans compute (rewritten per plan, like the shared block's,
        # and grown as needed; see _scratch): a mixed batch's decode rows' KV indptr from 0,
        # a paged extend's KV lengths, a mixed cascade's suffixes' query indptr and lengths.
        # Left to FlashInfer, the lengths would be derived into pageable memory, whose copy
        # to the device waits for the stream.
        self._pinned: dict[str, torch.Tensor] = {}

    # ---- planning --------------------------------------------------------------

    def decode_kernels(self, bs: int) -> tuple[bool, ...]:
        """The kernels (tensor cores or not) a plain decode batch of bs rows may run."""
        if self.tensor_cores or self.triton_decode:  # triton: one kernel, named by the head-group rule's
            return (self.tensor_cores,)
        return (False, True) if bs >= self.tensor_core_min_batch else (False,)

    def picks_tensor_cores(self, bs: int, kv_indptr_host: torch.Tensor, shared_len: int) -> bool:
        """The kernel for a plain decode batch run at size bs (its graph's, or its own)."""
        kernels = self.decode_kernels(bs)
        return kernels[0] if len(kernels) == 1 else prefers_tensor_cores(kv_indptr_host, shared_len)

    def _plan_decode(self, wrapper: object, kv_indptr_host: torch.Tensor, kv_indices: torch.Tensor) -> None:
        b = kv_indptr_host.numel() - 1
        lens = _host_lens(kv_indptr_host) if wrapper.use_tensor_cores else None  # type: ignore[attr-defined]
        wrapper.plan(  # type: ignore[attr-defined]
            kv_indptr_host, kv_indices, self._last_page_len(b), self.hq, self.hkv, self.d, 1,
            q_data_type=self.dtype, kv_data_type=self.kv_dtype, seq_lens=lens,
        )

    def _eager_decode(self, meta: AttnMetadata) -> object:
        assert meta.kv_indptr_host is not None
        b = meta.kv_indptr_host.numel() - 1
        if self.picks_tensor_cores(b, meta.kv_indptr_host, meta.shared_len) == self.tensor_cores:
            return self.decode
        if self._decode_tc is None:
            self._decode_tc = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True, backend="fa2")
        return self._decode_tc

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
        if meta.is_decode and meta.cascade is None and self.triton_decode:  # no plan: the kernel reads these
            self._mode = "triton"
            self._triton_args = (meta.kv_indptr, meta.kv_indices)
            return
        self._before_plan()
        if meta.cascade is not None and meta.is_decode:
            self._plan_cascade(meta.cascade)
        elif meta.is_decode:
            self._mode = "decode"
            self._active_decode = self._eager_decode(meta)
            self._plan_decode(self._active_decode, meta.kv_indptr_host, meta.kv_indices)
        else:
            self._plan_extend(meta)
        self._after_plan()

    def _plan_cascade(self, c: CascadeMeta) -> None:
        self._mode = "cascade"
        self._active_shared, self._active_decode = self.paged, self.decode
        self._plan_shared(self.paged, c.suffix_indptr_host.numel() - 1, c.shared_len, c.shared_indices)
        self._plan_decode(self.decode, c.suffix_indptr_host, c.suffix_indices)

    def _plan_shared(self, wrapper: object, b: int, p: int, shared_indices: torch.Tensor) -> None:
        """All b queries as one non-causal block over the p shared slots. The pinned
        inputs are rewritten in place: `_before_plan` saw the last plan's copies done."""
        self._shared_qo[1] = b
        self._shared_kv[1] = p
        self._shared_len[0] = p
        wrapper.plan(self._shared_qo, self._shared_kv, shared_indices,  # type: ignore[attr-defined]
                     self._last_page_len(1), self.hq, self.hkv, self.d, 1, causal=False, q_data_type=self.dtype,
                     kv_data_type=self.kv_dtype, seq_lens=self._shared_len)

    def reads_prefixes_apart(self, query_tokens: int) -> bool:
        return query_tokens > self.paged_extend_max_tokens  # the split path: ragged + paged prefix + merge

    def _plan_extend(self, meta: AttnMetadata) -> None:
        qo, kv_indptr = meta.qo_indptr_host, meta.kv_indptr_host
        assert qo is not None and kv_indptr is not None
        d = meta.decode_from
        paged = not self.reads_prefixes_apart(int(qo[-1]))
        # Some extend row has a cached prefix when its rows hold more slots than queries.
        e = len(meta.qo_lens) if d is None else d
        prefixed = int(kv_indptr[e]) > int(qo[e])
        # A mixed batch's decode rows run apart (decode kernel or cascade) when they share a
        # prefix or the batch is past the paged threshold; else they join the paged prefill,
        # one query each over its whole KV: one call a layer, not three and a cat.
        apart = d is not None and (meta.cascade is not None or not paged)
        if apart:
            assert d is not None
            qo = qo[: d + 1]
            self._plan_mixed_decode(meta, d)
        b = qo.numel() - 1
        self._active_paged = self.paged
        if paged and (prefixed or d is not None):
            self._extend_kind = "paged"
            # kv_indptr[: b + 1] bounds the planned rows' slots, which come first in kv_indices.
            self._plan_paged_extend(self.paged, qo, kv_indptr[: b + 1], meta.kv_indices, "extend_lens")
        elif not prefixed:
            self._extend_kind = "ragged"
        else:
            self._extend_kind = "split"
            assert meta.prefix_indptr_host is not None and meta.prefix_indices is not None
            self.paged.plan(qo, meta.prefix_indptr_host, meta.prefix_indices, self._last_page_len(b), self.hq,
                            self.hkv, self.d, 1, causal=False, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                            seq_lens=meta.prefix_lens_host)
        if self._extend_kind != "paged":
            self.ragged.plan(qo, qo, self.hq, self.hkv, self.d, causal=True, q_data_type=self.dtype,
                             kv_data_type=self.dtype)
        self._mode = "mixed" if apart else "extend"

    def _plan_paged_extend(self, wrapper: object, qo: torch.Tensor, kv: torch.Tensor, kv_indices: torch.Tensor,
                           lens_key: str) -> None:
        """One causal paged prefill over each request's whole KV (its new tokens' K/V in the
        pool already); qo and kv host indptrs of one size, the KV lengths pinned in `lens_key`."""
        wrapper.plan(qo, kv, kv_indices, self._last_page_len(qo.numel() - 1),  # type: ignore[attr-defined]
                     self.hq, self.hkv, self.d, 1, causal=True, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                     seq_lens=self._lens(lens_key, kv))

    def _scratch(self, key: str, n: int) -> torch.Tensor:
        """n int32 of the pinned buffer `key`, which each plan rewrites (`_before_plan` saw the
        last plan's copies done)."""
        buf = self._pinned.get(key)
        if buf is None or n > buf.numel():
            buf = self._pinned[key] = torch.zeros(max(n, 4097), dtype=torch.int32).pin_memory()
        return buf[:n]

    def _lens(self, key: str, indptr: torch.Tensor) -> torch.Tensor:
        """The row lengths of a host indptr, in the pinned buffer `key`."""
        lens = self._scratch(key, indptr.numel() - 1)
        torch.sub(indptr[1:], indptr[:-1], out=lens)
        return lens

    def _plan_mixed_decode(self, meta: AttnMetadata, d: int) -> None:
        """A mixed batch's decode rows (d on): with a cascade split, their shared block and
        their suffixes each on a paged prefill wrapper of its own; else the
        Triton kernel reads their slice of the batch's own indptr (offsets into its
        kv_indices), or a FlashInfer decode plan the same indptr from 0 over the slice of
        kv_indices it covers."""
        assert meta.qo_indptr_host is not None and meta.kv_indptr_host is not None
        self._extend_tokens = int(meta.qo_indptr_host[d])
        self._mixed_cascade = (c := meta.cascade) is not None
        if c is not None:
            if self._mixed_shared is None:
                self._mixed_shared = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
                self._mixed_suffix = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
            b = c.suffix_indptr_host.numel() - 1
            self._plan_shared(self._mixed_shared, b, c.shared_len, c.shared_indices)
            one_each = torch.arange(b + 1, dtype=torch.int32, out=self._scratch("suffix_qo", b + 1))
            assert self._mixed_suffix is not None
            self._mixed_suffix.plan(  # type: ignore[attr-defined]
                one_each, c.suffix_indptr_host, c.suffix_indices, self._last_page_len(b), self.hq,
                self.hkv, self.d, 1, causal=False, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                seq_lens=self._lens("suffix_lens", c.suffix_indptr_host))
            return
        if self.triton_decode:
            self._triton_args = (meta.kv_indptr[d:], meta.kv_indices)
            return
        kv = meta.kv_indptr_host[d:]
        indptr = torch.sub(kv, kv[0], out=self._scratch("decode_indptr", kv.numel()))
        self._active_decode = self.decode
        self._plan_decode(self.decode, indptr, meta.kv_indices[int(kv[0]):])

    # ---- CUDA graphs -------------------------------------------------------------

    def init_graph(self, bs: int, cascade: bool) -> None:
        """Graph-mode wrappers for batch size `bs` (before its capture): a decode
        wrapper per kernel of `decode_kernels(bs)`, and with `cascade` a shared-block
        prefill wrapper too (the suffix decode uses the head-group rule's wrapper)."""
        dev = self.device
        if self._graph_indices is None:
            # Sized by the first (largest) size: e.g. 256 x 40960 x 4 B = 42 MB for a 40k
            # context (134 MB at 128k). A padded row reads one slot, never more than a real one.
            self.graph_max_bs = bs
            self._graph_indices = (
                torch.zeros(graph_indices_len(bs, self.context_length), dtype=torch.int32, device=dev),
                torch.zeros(min(self.context_length, self.max_kv_tokens), dtype=torch.int32, device=dev))
        elif bs > self.graph_max_bs:
            raise ValueError(f"init_graph({bs}) after sizing the index buffers for {self.graph_max_bs}: "
                             "initialise the largest batch size first")
        if self.triton_decode:
            self._graph_indptr[bs] = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        for tc in self.decode_kernels(bs) if not self.triton_decode or cascade else ():  # triton: a cascade's suffix
            self.graph_decode[(bs, tc)] = self._graph_decode_wrapper(bs, tc)
        if cascade:
            self.graph_shared[bs] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(2, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=torch.zeros(2, dtype=torch.int32, device=dev),
                paged_kv_indices_buf=self._graph_indices[1],
                paged_kv_last_page_len_buf=torch.ones(1, dtype=torch.int32, device=dev),
                backend="fa2",
            )

    def _graph_decode_wrapper(self, bs: int, tensor_cores: bool) -> object:
        assert self._graph_indices is not None
        dev = self.device
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=self._graph_indices[0],
            paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev),
            backend="fa2",
        )

    def begin_graph_decode(self, bs: int, kv_indptr_host: torch.Tensor, kv_indices: torch.Tensor,
                           tensor_cores: bool) -> None:
        """Plan batch size `bs`'s decode graph of that kernel (kv_indptr_host has bs + 1
        entries, pinned)."""
        if self.triton_decode:
            assert self._graph_indices is not None
            indptr, buf = self._graph_indptr[bs], self._graph_indices[0]
            indptr.copy_(kv_indptr_host, non_blocking=True)  # pinned: queued, never a wait
            buf[: kv_indices.numel()].copy_(kv_indices)
            self._mode = "triton"
            self._triton_args = (indptr, buf)
            return
        w = self.graph_decode[(bs, tensor_cores)]
        self._mode = "decode"
        self._active_decode = w
        self._before_plan()
        self._plan_decode(w, kv_indptr_host, kv_indices)
        self._after_plan()

    def begin_graph_cascade(self, bs: int, shared_len: int, shared_indices: torch.Tensor,
                            suffix_indptr_host: torch.Tensor, suffix_indices: torch.Tensor, key: tuple = ()) -> None:
        """Plan batch size `bs`'s cascade graph: all bs rows (padding included) attend to
        the shared slots; suffix_indptr_host has bs + 1 entries, pinned. A non-empty `key`
        equal to the one this size's shared block was last planned with (CascadeMeta.key),
        and to the one whose slots the shared-index buffer holds, skips that plan: the
        wrapper's buffers still hold it."""
        self._mode = "cascade"
        self._active_shared, self._active_decode = self.graph_shared[bs], self.graph_decode[(bs, self.tensor_cores)]
        self._before_plan()
        if not key or self._shared_planned.get(bs) != key or self._shared_indices_key != key:
            self._plan_shared(self._active_shared, bs, shared_len, shared_indices)
            self._shared_planned[bs] = self._shared_indices_key = key
        self._plan_decode(self._active_decode, suffix_indptr_host, suffix_indices)
        self._after_plan()

    def init_extend_graph(self, max_tokens: int, max_reqs: int) -> None:
        """The graph-mode paged prefill wrapper of whole extend graphs (before their capture):
        batches of at most `max_reqs` requests and `max_tokens` query tokens. Its first plan
        is such a batch: FlashInfer sizes a graph-mode launch (query tile, CTA count) for
        the first plan's tokens and requests and keeps it for later plans, whose
        per-tile schedule it writes to the wrapper's buffers, where the kernel reads it."""
        dev = self.device
        max_reqs = self.graph_extend_reqs = min(max_reqs, max_tokens)  # each planned request has a token
        self.graph_extend = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(max_reqs + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.zeros(max_reqs + 1, dtype=torch.int32, device=dev),
            # A batch's requests read at most context_length slots each.
            paged_kv_indices_buf=torch.zeros(max(max_reqs * self.context_length, max_tokens), dtype=torch.int32,
                                              device=dev),
            paged_kv_last_page_len_buf=torch.ones(max_reqs, dtype=torch.int32, device=dev),
            backend="fa2",
        )
        one_each = torch.arange(max_reqs + 1, dtype=torch.int32)
        one_each[-1] = max_tokens  # the last request takes the tokens the others leave
        self.begin_graph_extend(one_each, one_each, torch.zeros(max_tokens, dtype=torch.int32, device=dev))

    def takes_extend_graph(self, meta: AttnMetadata) -> bool:
        """An extend without decode rows, of at most init_extend_graph's requests, whose
        eager plan is one paged prefill (some request reads cached KV, and the batch is
        within paged_extend_max_tokens): the graph runs that kernel too and saves the host
        its launches. Without cached KV the eager plan is the ragged prefill (FlashInfer's
        Hopper kernel on an H100), faster on the GPU than the graph-mode paged one
        (RESULTS.md, 2026-12-06, 05:49 UTC)."""
        qo, kv = meta.qo_indptr_host, meta.kv_indptr_host
        if self.graph_extend is None or meta.is_decode or meta.decode_from is not None or qo is None or kv is None:
            return False
        tokens = int(qo[-1])
        return (qo.numel() - 1 <= self.graph_extend_reqs and int(kv[-1]) > tokens
                and not self.reads_prefixes_apart(tokens))

    def begin_graph_extend(self, qo_indptr_host: torch.Tensor, kv_indptr_host: torch.Tensor,
                           kv_indices: torch.Tensor) -> None:
        """Plan an extend batch (one takes_extend_graph takes, of at most init_extend_graph's
        tokens) for a whole extend graph's replay: one causal paged prefill over each
        request's whole KV, its new tokens' K/V in the pool already. Empty requests pad
        the batch to the wrapper's count; query rows past the batch's tokens (a graph's
        padding) are left out of every request, and their output is zeros."""
        assert self.graph_extend is not None
        b, r = qo_indptr_host.numel() - 1, self.graph_extend_reqs
        qo, kv = self._scratch("graph_qo", r + 1), self._scratch("graph_kv", r + 1)
        qo[: b + 1].copy_(qo_indptr_host)
        qo[b + 1:] = qo_indptr_host[-1]
        kv[: b + 1].copy_(kv_indptr_host)
        kv[b + 1:] = kv_indptr_host[-1]
        self._before_plan()
        self._plan_paged_extend(self.graph_extend, qo, kv, kv_indices[: int(kv_indptr_host[-1])], "graph_lens")
        self._after_plan()
        self._mode, self._extend_kind, self._active_paged = "extend", "paged", self.graph_extend

    # ---- the layer call ----------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if self._mode == "triton":
            assert self._triton_args is not None
            return triton_decode_attention(q, k_cache, v_cache, *self._triton_args, scale)
        kv = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [slots, page=1, Hkv, D]
        if self._mode == "decode":
            return self._active_decode.run(q, kv)  # type: ignore[attr-defined]
        if self._mode == "extend":
            return self._extend(q, k, v, kv)
        if self._mode == "cascade":
            return self._cascade(self._active_shared, self._active_decode, q, kv)
        if self._mode == "mixed":
            t = self._extend_tokens
            head = self._extend(q[:t], k[:t], v[:t], kv)
            if self._mixed_cascade:
                tail = self._cascade(self._mixed_shared, self._mixed_suffix, q[t:], kv)
            elif self.triton_decode:
                assert self._triton_args is not None
                tail = triton_decode_attention(q[t:], k_cache, v_cache, *self._triton_args, scale)
            else:
                tail = self._active_decode.run(q[t:], kv)  # type: ignore[attr-defined]
            return torch.cat((head, tail))
        raise AssertionError(f"unknown mode {self._mode!r}")

    def _cascade(self, shared: object, own: object, q: torch.Tensor,
                 kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Queries over the shared block (one plan for them all) and over their own suffixes, merged."""
        o_shared, lse_shared = shared.run(q, kv, return_lse=True)  # type: ignore[attr-defined]
        o_own, lse_own = own.run(q, kv, return_lse=True)  # type: ignore[attr-defined]
        return self.fi.merge_state(o_shared, lse_shared, o_own, lse_own)[0]

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """An extend's new tokens over their cached prefixes and themselves (causal): by
        the planned kind (see _plan_extend)."""
        if self._extend_kind == "ragged":
            return self.ragged.run(q, k, v)
        if self._extend_kind == "paged":
            return self._active_paged.run(q, kv)  # type: ignore[attr-defined]
        o_new, lse_new = self.ragged.run(q, k, v, return_lse=True)
        o_pre, lse_pre = self.paged.run(q, kv, return_lse=True)
        return self.fi.merge_state(o_new, lse_new, o_pre, lse_pre)[0]


def graph_indices_len(max_bs: int, context_length: int) -> int:
    """KV index slots a captured decode batch of up to max_bs requests can need: each
    row reads at most context_length slots (a cascade's suffixes fewer)."""
    return max_bs * context_length
