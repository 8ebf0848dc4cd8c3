"""CUDA graphs for the batches decode's graphs do not take (prefill chunks, batches past
the largest decode graph), piecewise: everything of the forward but attention, captured
per padded token count.

An eager forward queues some ten kernels a layer from Python; for the few hundred
tokens of a lone prompt the GPU runs them faster than the host queues them, so the time
to first token is the host's (~7 ms at 28 layers, the kernels ~2.7 ms at 1,000 tokens
on an H200: benchmarks/prefill_cost.py). Attention cannot be captured like decode's:
its plan depends on every request's lengths. So each layer boundary splits the forward: piece 0 embeds
and runs layer 0 up to its attention; piece i (1..L-1) runs layer i-1 from its attention's
output through layer i's q/k/v (and KV write); piece L finishes the last layer and
normalises. Between pieces each layer's attention runs eagerly on the batch's real rows
alone, as planned for the batch, reading the pieces' fixed q/k/v buffers and writing
the fixed output buffer the next piece reads.

A batch of n tokens replays the smallest captured count T >= n: the padded rows read
token 0 at position 0 and write their K/V into the padding slot 0, which no request
reads; attention never sees them, and their outputs are dropped. The LM head runs
eagerly on the rows the batch wants (each request's last, prompt-logprob rows).
Every row's numbers are the eager forward's up to the GEMMs' choice of algorithm for
T rows instead of n.

Small extend batches replay one graph of the whole forward instead, attention included,
where the attention backend can capture it and takes the batch (FlashInfer: at most
WHOLE_MAX_TOKENS tokens over at most WHOLE_MAX_REQUESTS requests, no decode rows, some
cached KV read: a chat's next turn on its cached system prompt and earlier turns; one
graph-mode paged prefill wrapper, planned before each replay; see its
takes_extend_graph). The pieces' host time, a graph replay and an eager attention call a
layer, is most of such a batch's time (100 tokens on a 1,000-token prefix: 2.9-3.2 ms of
launch, 1.1-1.8 whole, on an H100): it is the gap a new prompt puts between its running
requests' tokens, and its own time to first token.

Not captured: engines with LoRA adapters (a batch's adapter rows change every step).
Capture happens once, at start-up, and again when released memory comes back."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from sgl.core.progress import progress_bar
from sgl.kernels.attention import AttnMetadata
from sgl.kernels.layers import RopeTables
from sgl.sched.models.forward_batch import ForwardBatch, ModelOnDevice

# Captured token counts: fine steps where padding would cost GPU time (a large prefill
# is GPU-bound), so that no batch pads by more than a third.
TOKEN_COUNTS = [16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072,
                4096, 5120, 6144, 8192, 10240, 12288, 16384]
# Whole graphs: extend batches up to these sizes (the captured token counts up to the first,
# each request count up to the second through empty requests). Past 256 tokens the graph's
# paged prefill, planned for its largest batch, cost the GPU more than the pieces saved the
# host (RESULTS.md, 2026-12-06, 05:49 UTC).
WHOLE_MAX_TOKENS = 256
WHOLE_MAX_REQUESTS = 8


class PieceAttention(Protocol):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor: ...


class PieceLayer(Protocol):
    """One decoder layer, split at its attention (sgl.sched.models.llama.DecoderLayer)."""

    self_attn: PieceAttention

    def before_attention(self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                         rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor,
                        fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]: ...


class PieceModel(Protocol):
    """What piecewise capture needs of a model: its forward in pieces."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeTables

    @property
    def decoder_layers(self) -> Sequence[PieceLayer]: ...
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def final_norm(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def supports_pieces(model: object) -> bool:
    return all(hasattr(model, a) for a in ("decoder_layers", "embed", "final_norm", "lm_logits"))


class PrefillGraphs:
    """The pieces of the forward, captured for each token count up to `max_tokens`, and
    the whole forward for the counts up to WHOLE_MAX_TOKENS where the attention backend
    supports it (capture=False runs the same pieces and wholes eagerly over the same
    padded buffers: the CPU tests' way to check the padding and the buffers)."""

    def __init__(self, runner: ModelOnDevice, max_tokens: int, capture: bool = True) -> None:
        m: PieceModel = runner.model  # type: ignore[assignment]
        self.model = m
        self.layers = list(m.decoder_layers)
        self.sizes = [t for t in TOKEN_COUNTS if t < max_tokens] + [max_tokens]
        backend = runner.attn_backend
        self.whole_sizes = [t for t in self.sizes if t <= WHOLE_MAX_TOKENS] if backend.supports_extend_graphs else []
        dev, dt, top = runner.device, runner.dtype, max_tokens
        with torch.inference_mode():
            hidden = m.embed(torch.zeros(1, dtype=torch.int64, device=dev)).shape[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(top, dtype=torch.int64, device=dev)  # padding rows: slot 0
        # The buffers between pieces: q/k/v into each attention, its output, the residual
        # stream, and the final-norm hidden states.
        self.q = torch.zeros(top, m.num_heads, m.head_dim, dtype=dt, device=dev)
        self.k = torch.zeros(top, m.num_kv_heads, m.head_dim, dtype=dt, device=dev)
        self.v = torch.zeros_like(self.k)
        self.o = torch.zeros(top, m.num_heads * m.head_dim, dtype=dt, device=dev)
        self.residual = torch.zeros(top, hidden, dtype=dt, device=dev)
        self.hidden = torch.zeros(top, hidden, dtype=dt, device=dev)
        self.pieces: dict[int, list[Callable[[], Any]]] = {}
        self.whole: dict[int, Callable[[], Any]] = {}
        self._pool: Any = None
        if self.whole_sizes:
            backend.init_extend_graph(self.whole_sizes[-1], WHOLE_MAX_REQUESTS)
        if not capture:
            self.pieces = {t: self._pieces(runner, t) for t in self.sizes}
            self.whole = {t: self._whole(runner, t) for t in self.whole_sizes}
            return
        gc.collect()  # as for the decode graphs: no collection of another engine's graphs during a capture
        with progress_bar(total=len(self.sizes) * (len(self.layers) + 1) + len(self.whole_sizes),
                          desc="Capturing prefill graphs", unit="graph") as bar:
            for t in sorted(self.sizes, reverse=True):
                graphs = []
                for fn in self._pieces(runner, t):
                    graphs.append(self._graph(fn, runner.device).replay)
                    bar.update()
                self.pieces[t] = graphs
            for t in sorted(self.whole_sizes, reverse=True):
                # Any plan will do: the launch FlashInfer captures was sized by the first.
                one = torch.tensor([0, t], dtype=torch.int32)
                backend.begin_graph_extend(one, one, torch.zeros(t, dtype=torch.int32, device=runner.device))
                self.whole[t] = self._graph(self._whole(runner, t), runner.device).replay
                bar.update()
        torch.cuda.synchronize(runner.device)

    def can_run(self, tokens: int) -> bool:
        return tokens <= self.sizes[-1]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, bool]:
        """The batch's logits rows (fb.logits_indices), its pooled rows into fb.pool, and
        whether a whole graph ran it. Plans fb's attention backend for the batch (n real
        tokens) itself: for a whole graph's replay, or for the eager attention between pieces."""
        n = input_ids.shape[0]
        t = next(s for s in self.sizes if s >= n)
        meta = fb.attn
        whole = self.whole.get(t)
        if whole is not None and not fb.attn_backend.takes_extend_graph(meta):
            whole = None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(fb.positions)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        if t > n:
            self.input_ids[n:t].zero_()
            self.positions[n:t].zero_()
            self.out_cache_loc[n:t].zero_()
        if whole is not None:
            assert meta.qo_indptr_host is not None and meta.kv_indptr_host is not None
            fb.attn_backend.begin_graph_extend(meta.qo_indptr_host, meta.kv_indptr_host, meta.kv_indices)
            whole()
        else:
            fb.attn_backend.begin_forward(meta)
            pieces = self.pieces[t]
            q, k, v, o = self.q[:n], self.k[:n], self.v[:n], self.o[:n]
            pieces[0]()
            for layer, piece in zip(self.layers, pieces[1:]):
                o.copy_(layer.self_attn.attend(q, k, v, fb))
                piece()
        hidden = self.hidden[:t]
        if fb.pool is not None:
            fb.pool.pool(hidden[fb.pool.rows])
        return self.model.lm_logits(hidden[fb.logits_indices]), whole is not None

    def _batch(self, runner: ModelOnDevice, t: int) -> ForwardBatch:
        """The fixed buffers' first t rows as a batch. Its metadata is never read: pieces
        never attend, and a whole graph's attention reads what the backend was planned with."""
        dev = runner.device
        one = torch.zeros(2, dtype=torch.int32, device=dev)
        unused = AttnMetadata(False, one, one, one[:0], [t], [t])
        return ForwardBatch(self.input_ids[:t], self.positions[:t], self.out_cache_loc[:t],
                            torch.zeros(1, dtype=torch.int64, device=dev), unused, runner.attn_backend, runner.kv_pool)

    def _whole(self, runner: ModelOnDevice, t: int) -> Callable[[], None]:
        """The whole forward at t tokens, from the fixed input buffers to the final-norm one."""
        m, layers, fb = self.model, self.layers, self._batch(runner, t)

        def whole() -> None:
            h, residual = m.embed(fb.input_ids), None
            for layer in layers:
                h, residual = layer.forward(h, residual, fb, m.rope)
            assert residual is not None
            self.hidden[:t].copy_(m.final_norm(h, residual))
        return whole

    def _pieces(self, runner: ModelOnDevice, t: int) -> list[Callable[[], None]]:
        """The forward's L + 1 pieces at t tokens, reading and writing the fixed buffers."""
        m, layers = self.model, self.layers
        fb = self._batch(runner, t)

        def keep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> None:
            for buf, x in ((self.q, q), (self.k, k), (self.v, v), (self.residual, residual)):
                if x.data_ptr() != buf.data_ptr():  # the fused kernels update the residual in place
                    buf[:t].copy_(x)

        def first() -> None:
            keep(*layers[0].before_attention(m.embed(fb.input_ids), None, fb, m.rope))

        def between(i: int) -> Callable[[], None]:
            def piece() -> None:
                h, residual = layers[i - 1].after_attention(self.o[:t], self.residual[:t], fb)
                keep(*layers[i].before_attention(h, residual, fb, m.rope))
            return piece

        def last() -> None:
            h, residual = layers[-1].after_attention(self.o[:t], self.residual[:t], fb)
            self.hidden[:t].copy_(m.final_norm(h, residual))

        return [first, *(between(i) for i in range(1, len(layers))), last]

    def _graph(self, fn: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
        with torch.inference_mode():
            fn()  # warm up: lazy initialisation (kernel compiles, autotuning) must not happen inside capture
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            # thread_local: only this thread's calls can break the capture (see cuda_graph.py).
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                fn()
        self._pool = g.pool()
        return g
