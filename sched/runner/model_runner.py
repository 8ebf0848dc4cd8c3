"""ModelRunner: owns the model, the KV pools and the attention backend; turns a
ScheduleBatch into a ForwardBatch, runs the forward and samples.

The pools are sized and built by sgl.cache.pools, batches prepared on the host by
sgl.sched.runner.prepare; a launched step's handle and results are
sgl.sched.runner.step's. It decides nothing about which requests run: that is the
scheduler's job."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from sgl.cache.pools import build_kv_pools, default_kv_tokens
from sgl.core.log import get_logger
from sgl.core.logit_processor import CustomLogitProcessor
from sgl.core.server_args import ServerArgs
from sgl.kernels.attention import AttentionBackend
from sgl.kernels.gumbel_draw import Bitmask
from sgl.kernels.sampling import FusedDraw
from sgl.kernels.torch_attention import TorchAttentionBackend
from sgl.kernels.trie_mask import trie_advance, trie_mask_
from sgl.sched.batch import ScheduleBatch
from sgl.sched.models.forward_batch import CausalLM, ForwardBatch
from sgl.sched.models.parallel import TPGroup
from sgl.sched.runner.beam_select import BeamBuffers, select
from sgl.sched.runner.gpu_timeline import GpuTimeline
from sgl.sched.runner.grammar_masks import GrammarFill, MaskFiller
from sgl.sched.runner.prepare import BatchPreparer, PreparedBatch
from sgl.sched.runner.sampler import fused_takes, process_logits, sample
from sgl.sched.runner.step import CudaLaunched, Deferred, Launched, Ready, StepResult

if TYPE_CHECKING:
    from sgl.sched.models.model_config import AnyConfig
    from sgl.sched.req import Req
    from sgl.sched.runner.cuda_graph import CudaGraphRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# chunked_prefill_size=None: by GPU memory (GiB, exclusive bound -> tokens), SGLang's
# defaults below 90 GiB; an H200 (141 GB) or larger gets 16384 (vLLM's offline default
# there; SGLang gives an H200 8192): W3 without the prefix cache (537,600 prefill tokens)
# ran 4-5% faster with it on one H200 (benchmarks/RESULTS.md, session 9), half as many
# prefill batches for the host to build. Prompt-logprob rows are bounded apart
# (sgl.sched.prefill_adder).
GPU_CHUNK_DEFAULTS = [(20, 2048), (35, 2048), (60, 4096), (90, 8192)]
GPU_CHUNK_LARGEST = 16384
# On CPU: the forward's cost grows linearly with its tokens already (no device to fill),
# so larger chunks gain little throughput, while they stall every decoding request for
# the whole chunk and size the [chunk, V] float32 prompt-logprob rows (2048 x 49152 x 4 B
# = 0.4 GB for the default SmolLM2): SGLang's smallest GPU default.
CPU_CHUNK_DEFAULT = 2048


def resolve_device(args: ServerArgs) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available: pass device='cpu' or run on a GPU machine")
    return torch.device(args.device)


def chunked_prefill_size(args: ServerArgs, device: torch.device) -> int | None:
    """The prefill chunk in tokens: the given one, SGLang's default for the device's
    memory when None, or None (no chunking) for -1."""
    if args.chunked_prefill_size is not None:
        return None if args.chunked_prefill_size == -1 else args.chunked_prefill_size
    if device.type != "cuda":
        return CPU_CHUNK_DEFAULT
    gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    return next((n for bound, n in GPU_CHUNK_DEFAULTS if gib < bound), GPU_CHUNK_LARGEST)


def eos_ids_of(config: Any, model_path: str) -> set[int]:
    """The model's EOS ids: its config's and its generation config's."""
    ids: set[int] = set()
    for src in (config, _generation_config(model_path)):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


def _generation_config(model_path: str) -> Any:
    """generation_config.json's keys (no transformers import: it costs seconds of a start)."""
    path = Path(model_path) / "generation_config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return SimpleNamespace(**values) if isinstance(values, dict) else None


def resolve_dtype(args: ServerArgs, device: torch.device) -> torch.dtype:
    if args.dtype != "auto":
        return _DTYPES[args.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str, tp: TPGroup = TPGroup()) -> None:
        self.log = get_logger("scheduler")
        self.tp = tp
        self.device = resolve_device(args)
        off = args.disable_overlap_schedule
        self.overlap = self.device.type == "cuda" if off is None else not off
        # The CPU overlap loop runs each forward on this thread; CUDA queues kernels instead.
        self.worker = (ThreadPoolExecutor(1, thread_name_prefix="sgl-forward")
                       if self.device.type == "cpu" and self.overlap else None)
        self.dtype = resolve_dtype(args, self.device)
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        # Start-up phases in seconds (weights, KV pools, CUDA graphs), logged and in the scheduler's info.
        t0 = time.perf_counter()
        self.model, self.config = self._load(args, model_path)
        self.startup = {"weights_s": time.perf_counter() - t0}
        self.vocab_size: int = self.model.vocab_size
        # Grammar bitmasks' width (the tokenizer's ids), set by the scheduler's grammars once one compiled.
        self.grammar_vocab = self.vocab_size
        self.masks = MaskFiller(self.device, frozenset())  # grammar bitmasks (sgl.sched.runner.step.Deferred)
        # The model's own limit (its rotary table); the null model has none.
        limit: int | None = getattr(self.model, "context_len", None)
        if args.context_length is not None and limit is not None and args.context_length > limit:
            raise ValueError(f"context_length={args.context_length} exceeds the model's {limit}")
        self.context_length = args.context_length or limit or int(getattr(self.config, "max_position_embeddings", 4096))
        self.chunked_prefill_size = chunked_prefill_size(args, self.device)
        m = self.model
        self.kv_dtype = _KV_DTYPES.get(args.kv_cache_dtype, self.dtype)
        slots = args.max_total_tokens
        if slots is None and tp.size > 1:  # every rank must hold the same slots: the smallest pool fits all
            slots = tp.min_int(default_kv_tokens(m.num_layers, m.num_kv_heads, m.head_dim, self.kv_dtype,
                                                 self.device, args.mem_fraction_static))
        t0 = time.perf_counter()
        pools = build_kv_pools(m.num_layers, m.num_kv_heads, m.head_dim, self.kv_dtype, self.device,
                               self.context_length, slots, args.max_running_requests, args.mem_fraction_static)
        self.startup["kv_pool_s"] = time.perf_counter() - t0
        self.max_total_tokens = pools.max_total_tokens
        self.max_running_requests = pools.max_running_requests
        self.kv_pool = pools.kv_pool
        self.allocator = pools.allocator
        self.req_to_token_pool = pools.req_to_token_pool
        self.attn_backend = self._attention_backend(args)
        on = args.enable_cascade_attention
        self.cascade = self.attn_backend.supports_cascade and (
            self.attn_backend.cascade_by_default if on is None else on)
        self.preparer = BatchPreparer(self)
        self.cascade_steps = 0
        # The future-token buffer: the last sampled token of each request row.
        self.next_token = torch.zeros(self.max_running_requests, dtype=torch.int64, device=self.device)
        # Output-token counts per request row for penalties: allocated when first needed,
        # each penalised row rewritten from the host at its (re-)prefill, advanced per step.
        self.counts: torch.Tensor | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self.eos_dev = torch.empty(0, dtype=torch.int64, device=self.device)
        rows = self.req_to_token_pool.size
        self.beam_buffers = BeamBuffers(torch.zeros(rows, dtype=torch.float32, device=self.device),
                                        torch.zeros(rows, dtype=torch.int64, device=self.device))
        self.processors: dict[str, CustomLogitProcessor] = {}
        self.generator = torch.Generator(self.device)
        self.generator.manual_seed(args.random_seed if args.random_seed is not None else 0)
        self.fused_draw = FusedDraw.ready(self.device, args.random_seed or 0, self.vocab_size, self.dtype,
                                          masks=args.grammar_backend != "none")
        self.gpu_timeline = GpuTimeline()
        self.graphs: CudaGraphRunner | None = None
        t0 = time.perf_counter()
        if self.device.type == "cuda" and not args.disable_cuda_graph and args.load_format != "null":
            from sgl.sched.runner.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, min(args.cuda_graph_max_bs, self.max_running_requests))
        self.startup["cuda_graphs_s"] = time.perf_counter() - t0
        self.log.info(
            "model ready", device=str(self.device), dtype=str(self.dtype), kv_tokens=self.max_total_tokens,
            kv_gib=round(self.kv_pool.nbytes() / 2**30, 2), attention=type(self.attn_backend).__name__,
            decode_attention=self.decode_attention,
            context_length=self.context_length, max_running_requests=self.max_running_requests,
            cuda_graph_sizes=self.graphs.sizes if self.graphs else None,
            **{k: round(v, 2) for k, v in self.startup.items()},
        )

    @property
    def decode_attention(self) -> str:
        """Plain decode's kernel: "triton", "flashinfer", or "torch"."""
        b = self.attn_backend
        return "torch" if not hasattr(b, "triton_decode") else "triton" if b.triton_decode else "flashinfer"

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self._eos_ids = frozenset(ids)
        self.masks.stop_ids = self._eos_ids  # a grammar's stop tokens are the model's EOS (sgl.sched.grammar)
        self.eos_dev = torch.tensor(sorted(ids), dtype=torch.int64, device=self.device)

    def _attention_backend(self, args: ServerArgs) -> AttentionBackend:
        choice = args.attention_backend
        if choice == "auto":
            choice = "flashinfer" if self.device.type == "cuda" and self.dtype != torch.float32 else "torch"
        if choice == "torch" or args.load_format == "null":
            if args.decode_attention_backend != "auto" and args.load_format != "null":
                raise ValueError(f"decode_attention_backend={args.decode_attention_backend!r} picks a kernel of "
                                 "attention_backend='flashinfer' (a CUDA device, bf16 or fp16), and this engine runs "
                                 "the torch backend: leave decode_attention_backend='auto'")
            return TorchAttentionBackend()
        if self.device.type != "cuda":
            raise ValueError("attention_backend='flashinfer' needs a CUDA device: pass attention_backend='torch'")
        from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend
        from sgl.kernels.triton_decode import handles

        ok = handles(self.device, self.kv_dtype)
        triton = args.decode_attention_backend == "triton" or (args.decode_attention_backend == "auto" and ok)
        if triton and not ok:
            raise ValueError("decode_attention_backend='triton' needs the triton package (pip install triton), and "
                             "for an FP8 kv_cache_dtype a GPU of compute capability 8.9+; or pass "
                             "decode_attention_backend='flashinfer'")
        m = self.model
        return FlashInferAttentionBackend(m.num_heads, m.num_kv_heads, m.head_dim, self.dtype, self.device,
                                          self.max_total_tokens + 1, context_length=self.context_length,
                                          tensor_core_min_batch=args.tensor_core_decode_min_batch,
                                          kv_dtype=self.kv_dtype, triton_decode=triton)

    def _load(self, args: ServerArgs, model_path: str) -> tuple[CausalLM, AnyConfig]:
        if args.load_format == "null":
            from sgl.sched.models.loader import hf_config
            from sgl.sched.models.null import NullModel

            config = hf_config(Path(model_path), args.trust_remote_code)
            return NullModel(config.vocab_size, self.device), config
        from sgl.sched.models.loader import load_model

        model, config = load_model(model_path, args.load_format, self.dtype, self.device,
                                   seed=args.random_seed or 0, tp=self.tp)
        return model, config  # in eval mode already

    def _mask(self, processed: torch.Tensor, logits: torch.Tensor, p: PreparedBatch,
              fill: GrammarFill | None) -> torch.Tensor:
        """Each trie row keeps only its node's children (EOS where a sequence ends), each
        grammar row only the tokens its bitmask allows."""
        if processed is logits and p.beam_src is None:
            processed = processed.to(torch.float32, copy=True)  # never mask the model's own buffer
        nodes = self.beam_buffers.node
        for tg in p.tries:
            if tg.init_rows is not None:
                nodes[tg.init_rows] = tg.init_nodes  # type: ignore[assignment]
            rows = processed[tg.entries]
            trie_mask_(rows, tg.trie, nodes[p.rows[tg.entries]], tg.width, self.eos_dev)
            processed[tg.entries] = rows
        if (g := p.grammar) is not None:
            from xgrammar import apply_token_bitmask_inplace

            assert fill is not None
            rows = processed if g.entries is None else processed[g.entries]
            apply_token_bitmask_inplace(rows, fill.mask, vocab_size=g.width)
            if g.width < rows.shape[1]:
                rows[:, g.width:] = float("-inf")  # past the tokenizer's ids: never a grammar's token
            if g.entries is not None:
                processed[g.entries] = rows
        return processed

    def prepare(self, batch: ScheduleBatch) -> PreparedBatch:
        """Host side, at build time: every tensor the forward needs, copied from the
        request state so that the scheduler may change it while the batch runs.
        Nothing here waits for the device (sgl.sched.runner.prepare)."""
        return self.preparer.prepare(batch)

    def launch(self, p: PreparedBatch) -> Launched:
        """Start a prepared batch; `.result()` of the returned handle gives its StepResult
        on the host. On CUDA the kernels are queued and the results come back through
        pinned buffers and an event, so the caller works on while the GPU runs (the
        overlap loop needs no thread there). On CPU the forward runs on the worker
        thread when there is one, else right away. A batch with grammar rows gives a
        Deferred handle: its forward is queued now, its masks are filled from `start()`
        (once the previous step's results are in the matchers) and its sampling queued
        at `complete()`, so grammar requests keep the overlap loop."""
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            logits = self._logits(p)

            def rest(fill: GrammarFill | None) -> Launched:
                step = self._sample(p, logits, fill).to_host(non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                return CudaLaunched(step, start, done, self.gpu_timeline, p.attn.is_decode)
        elif self.worker is not None:
            worker = self.worker
            forward = worker.submit(self._logits, p)

            def rest(fill: GrammarFill | None) -> Launched:
                return worker.submit(lambda: self._sample(p, forward.result(), fill).to_host(non_blocking=False))
        else:
            ready = self._logits(p)

            def rest(fill: GrammarFill | None) -> Launched:
                return Ready(self._sample(p, ready, fill).to_host(non_blocking=False))
        return rest(None) if p.grammar is None else self._deferred(p, rest)

    def _deferred(self, p: PreparedBatch, rest: Callable[[GrammarFill | None], Launched]) -> Deferred:
        """The handle of a batch with grammar rows: `start` sets its matchers to take the
        last tokens and fill the bitmasks on the fill threads, `complete` waits for them
        (or does it all now, if never started) and queues the rest of the step."""
        assert p.grammar is not None
        g = p.grammar
        started: list[Any] = []

        def start(just: dict[Req, int] | None) -> None:
            started.append(self.masks.start(g, just))

        def complete() -> Launched:
            return self.masks.then(rest, self.masks.finish(started[0]) if started else self.masks.fill(g))

        return Deferred(start, complete, moves_rows=bool(p.beams))

    def close(self) -> None:
        """Stop the runner's threads (the forward worker, the grammar fill threads)."""
        if self.worker is not None:
            self.worker.shutdown(wait=False, cancel_futures=True)
        self.masks.close()

    @torch.inference_mode()
    def _logits(self, p: PreparedBatch) -> torch.Tensor:
        """Queue one batch's forward: the logits rows it computes, on the device."""
        # Decode inputs are the tokens the previous step sampled, still on the device.
        input_ids = self.next_token[p.rows] if p.input_ids is None else p.input_ids
        if p.attn.is_decode and self.graphs is not None and self.graphs.can_run(len(p.attn.qo_lens)):
            return self.graphs.replay(p, input_ids)
        self.attn_backend.begin_forward(p.attn)
        fb = ForwardBatch(
            input_ids=input_ids,
            positions=p.positions,
            out_cache_loc=p.out_cache_loc,
            logits_indices=p.logits_indices,
            attn=p.attn,
            attn_backend=self.attn_backend,
            kv_pool=self.kv_pool,
        )
        return self.model(fb)

    @torch.inference_mode()
    def _sample(self, p: PreparedBatch, all_logits: torch.Tensor, fill: GrammarFill | None) -> StepResult:
        """Queue the rest of one batch after its forward: the sampled next token of each
        request and, when asked, logprobs (log_softmax of the raw logits, before bias,
        penalties and temperature), as device tensors. A graph's logits are its output
        buffer: this is queued before the next forward, so it reads them first."""
        logits = all_logits if p.sample_rows is None else all_logits[p.sample_rows]
        counts = None
        if p.sampling.penalties is not None:
            assert self.counts is not None
            if p.counts_reset is not None:
                rows, at_rows, at_ids = p.counts_reset
                self.counts[rows] = 0
                self.counts.index_put_((at_rows, at_ids), torch.ones_like(at_ids, dtype=torch.int32), accumulate=True)
            counts = self.counts[p.rows]
        errors: dict[int, str] = {}
        if p.beam_src is not None:  # beams are scored in log-probabilities, processors included (HF's order)
            logits = logits.to(torch.float32, copy=True)
            logits[p.beam_src] = torch.log_softmax(logits[p.beam_src], dim=-1)
        processed = process_logits(logits, p.sampling, counts, errors)
        bitmask = None
        if fill is not None and fill.errors:
            errors.update(fill.errors)
        sb, fused = p.sampling, self.fused_draw
        if ((g := p.grammar) is not None and not p.tries and p.beam_src is None and fused is not None
                and fused_takes(sb, fused) and fused.one_pass(sb.need_top_k, sb.need_top_p)):
            assert fill is not None  # the draw applies the bitmask in its one read of the logits: no masked copy
            bitmask = Bitmask(fill.mask, g.mask_rows, g.width)
        elif p.tries or g is not None:
            processed = self._mask(processed, logits, p, fill)
        next_ids = sample(processed, p.sampling, self.generator, self.fused_draw, bitmask)
        self.next_token[p.rows] = next_ids
        if self.counts is not None:
            self.counts[p.rows, next_ids] += 1
        for tg in p.tries:
            if tg.advance is not None:
                self.beam_buffers.node[tg.advance_rows] = trie_advance(
                    tg.trie, self.beam_buffers.node[tg.advance_rows], next_ids[tg.advance])
        table = self.req_to_token_pool.mirror
        picks = [select(processed, g, table, self.next_token, self.beam_buffers) for g in p.beams]
        out = StepResult(next_ids, errors=errors, beams=picks or None)
        if (lp := p.logprobs) is not None:
            logp = torch.log_softmax(all_logits.float(), dim=-1)
            assert p.sample_rows is not None
            targets = lp.targets.index_put((p.sample_rows,), next_ids)
            out.token = logp.gather(1, targets[:, None])[:, 0]
            if lp.top_k > 0:
                vals, ids = logp.topk(min(lp.top_k, logp.shape[-1]), dim=-1)
                out.top_vals, out.top_ids = vals, ids
            if lp.id_rows is not None:
                out.ids_vals = logp.gather(1, lp.id_rows)
        return out
