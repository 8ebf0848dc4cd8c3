"""CUDA graphs for decode: the model's forward captured once per padded batch
size, replayed with fresh inputs copied into fixed buffers.

A batch of b requests replays the smallest captured size bs >= b; the padded rows
read token 0 at position 0, write their KV into the padding slot 0 and attend to
it alone, and their logits are dropped. The attention plan runs before each
replay, outside the graph. Capture happens once, at start-up."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from sgl.kernels.attention import AttnMetadata
from sgl.sched.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from sgl.sched.model_runner import ModelRunner, PreparedBatch

_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        backend = runner.attn_backend
        if not hasattr(backend, "init_graph_decode"):
            raise ValueError("CUDA graphs need attention_backend='flashinfer' (or pass disable_cuda_graph=True)")
        self.backend = backend
        self.sizes = [s for s in _SIZES if s < max_bs] + [max_bs]
        dev = runner.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs", unit="graph",
                       disable=None):
            backend.init_graph_decode(bs)
            indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev)
            meta = AttnMetadata(True, indptr, indptr, torch.zeros(bs, dtype=torch.int32, device=dev), [1] * bs, [1] * bs)
            fb = ForwardBatch(self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs],
                              self.logits_indices[:bs], meta, backend, runner.kv_pool)
            for _ in range(2):  # warm up: lazy initialisation must not happen inside capture
                runner.model(fb)
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[bs] = runner.model(fb)
            pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize(dev)

    def can_run(self, b: int) -> bool:
        return b <= self.sizes[-1]

    def replay(self, p: PreparedBatch, input_ids: torch.Tensor) -> torch.Tensor:
        b = len(p.attn.qo_lens)
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(p.positions)
        self.out_cache_loc[:b].copy_(p.out_cache_loc)
        indptr, indices = p.attn.kv_indptr_host, p.attn.kv_indices
        assert indptr is not None
        if bs > b:
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_cache_loc[b:bs].zero_()
            pad = torch.arange(1, bs - b + 1, dtype=torch.int32) + indptr[-1]
            indptr = torch.cat([indptr, pad]).pin_memory()  # a pageable indptr would make plan sync
            indices = torch.cat([indices, torch.zeros(bs - b, dtype=indices.dtype, device=indices.device)])
        self.backend.begin_graph_decode(bs, indptr, indices)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
