"""CUDA graphs for decode: the model's forward captured once per padded batch
size, replayed with fresh inputs copied into fixed buffers.

A batch of b requests replays the smallest captured size bs >= b; the padded rows
read token 0 at position 0, write their KV into the padding slot 0 and attend to
it alone (and, in a cascade batch, to the shared prefix too), and their logits are
dropped. Each size is captured once per decode kernel the backend may pick for it
(FlashInfer: the decode kernel, and from some batch size its tensor-core kernel too,
chosen per batch by `picks_tensor_cores`), and with cascade attention on once more
for cascade decode (shared block + per-request suffix + merge). The attention plan
runs before each replay, outside the graph. Capture happens once, at start-up. The
target model has such graphs, and a speculative draft model its own (each a
ModelOnDevice: its weights, KV pool and attention backend)."""

from __future__ import annotations

import gc
from typing import Any

import torch

from sgl.core.progress import progress_bar
from sgl.kernels.attention import AttnMetadata
from sgl.kernels.lora import LoraBatch
from sgl.sched.models.forward_batch import ForwardBatch, ModelOnDevice

_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


class CudaGraphRunner:
    def __init__(self, runner: ModelOnDevice, max_bs: int) -> None:
        backend = runner.attn_backend
        if not hasattr(backend, "init_graph"):
            raise ValueError("CUDA graphs need attention_backend='flashinfer' (or pass disable_cuda_graph=True)")
        self.backend = backend
        self.cascade = runner.cascade
        self.sizes = [s for s in _SIZES if s < max_bs] + [max_bs]
        dev = runner.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=dev)
        # Each size's LoRA blocks (views of one set of buffers): a replay copies its batch's in.
        lora = LoraBatch.buffers(LoraBatch.max_blocks(max_bs, max_bs), max_bs, dev) if runner.lora_spec else None
        self.lora = {bs: lora.view(LoraBatch.max_blocks(bs, bs), bs) for bs in self.sizes} if lora is not None else {}
        # (kind, bs) -> the graph and its output buffer; kind: "cascade", or plain decode's
        # kernel ("tc" tensor cores, "decode")
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool (torch's handle), set by the first capture
        kinds = {bs: [_kind(tc) for tc in backend.decode_kernels(bs)] + (["cascade"] if self.cascade else [])
                 for bs in self.sizes}
        # A collection now, not inside a capture: the garbage of an engine closed earlier in
        # this process (its graphs sit in reference cycles) freed during a capture destroys
        # graphs there, which breaks it ("operation failed due to a previous error during
        # capture": a GPU test's second engine in one process; thread_local mode does not help,
        # since the collector runs on the capturing thread).
        gc.collect()
        with progress_bar(total=sum(map(len, kinds.values())), desc="Capturing CUDA graphs", unit="graph") as bar:
            for bs in sorted(self.sizes, reverse=True):
                backend.init_graph(bs, self.cascade)
                indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev)
                meta = AttnMetadata(True, indptr, indptr, torch.zeros(bs, dtype=torch.int32, device=dev),
                                    [1] * bs, [1] * bs)
                fb = ForwardBatch(self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs],
                                  self.logits_indices[:bs], meta, backend, runner.kv_pool, lora=self.lora.get(bs))
                # A valid plan for capture: every row attends to the padding slot alone
                # (in a cascade, to a shared prefix of that one slot and a suffix of it).
                slot0 = torch.zeros(bs, dtype=torch.int32, device=dev)
                one_each = torch.arange(bs + 1, dtype=torch.int32).pin_memory()
                for kind in kinds[bs]:
                    if kind == "cascade":
                        backend.begin_graph_cascade(bs, 1, slot0[:1], one_each, slot0)
                    else:
                        backend.begin_graph_decode(bs, one_each, slot0, kind == "tc")
                    self.graphs[(kind, bs)] = self._capture(runner, fb)
                    bar.update()
        torch.cuda.synchronize(dev)

    def _capture(self, runner: ModelOnDevice, fb: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        for _ in range(2):  # warm up: lazy initialisation must not happen inside capture
            runner.model(fb)
        torch.cuda.synchronize(runner.device)
        g = torch.cuda.CUDAGraph()
        # thread_local: only this thread's calls can break the capture. Under "global" (torch's
        # default) any thread's unsafe CUDA call does, and an inproc engine shares its process
        # with the caller's threads and with other engines (a GPU test's second engine failed
        # to start: "operation failed due to a previous error during capture").
        with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
            out = runner.model(fb)
        self._pool = g.pool()
        return g, out

    def can_run(self, b: int) -> bool:
        return b <= self.sizes[-1]

    def replay(self, attn: AttnMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
               out_cache_loc: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """The logits of a decode batch (one row per request) of `attn`'s rows."""
        b = len(attn.qo_lens)
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.out_cache_loc[:b].copy_(out_cache_loc)
        if lora is not None:
            lora.copy_into(self.lora[bs])
        if bs > b:
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_cache_loc[b:bs].zero_()
        c = attn.cascade
        if c is None:
            assert attn.kv_indptr_host is not None
            tc = self.backend.picks_tensor_cores(bs, attn.kv_indptr_host, attn.shared_len)
            indptr, indices = _pad(attn.kv_indptr_host, attn.kv_indices, bs)
            self.backend.begin_graph_decode(bs, indptr, indices, tc)
            kind = _kind(tc)
        else:
            indptr, indices = _pad(c.suffix_indptr_host, c.suffix_indices, bs)
            self.backend.begin_graph_cascade(bs, c.shared_len, c.shared_indices, indptr, indices, c.key)
            kind = "cascade"
        graph, out = self.graphs[(kind, bs)]
        graph.replay()
        return out[:b]


def _kind(tensor_cores: bool) -> str:
    return "tc" if tensor_cores else "decode"


def _pad(indptr: torch.Tensor, indices: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's KV indptr/indices with rows up to bs, each padded row on slot 0 alone."""
    b = indptr.numel() - 1
    if bs == b:
        return indptr, indices
    pad = torch.arange(1, bs - b + 1, dtype=torch.int32) + indptr[-1]
    indptr = torch.cat([indptr, pad]).pin_memory()  # a pageable indptr would make plan sync
    return indptr, torch.cat([indices, torch.zeros(bs - b, dtype=indices.dtype, device=indices.device)])
