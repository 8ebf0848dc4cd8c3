"""ModelRunner: owns the model, the KV pools, the attention backend, the CUDA graphs
and the sampling state; prepares a ScheduleBatch (sgl.sched.runner.prepare), queues
its forward and its sampling (sgl.sched.runner.sampling_state) and hands back the
launched Step (sgl.sched.runner.step). It is complete once constructed: nothing
outside sets its state. Between batches the weights change through `weights`
(sgl.sched.runner.weights), and the device memory of the weights and the KV cache is
released and resumed here (`release_memory`, `resume_memory`).

It decides nothing about which requests run: that is the scheduler's job."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from sgl.cache.kv_pool import MHATokenToKVPool
from sgl.cache.pools import build_kv_pools, default_kv_tokens
from sgl.core.log import get_logger
from sgl.core.logit_processor import resolve
from sgl.core.protocol import MEMORY_TAGS
from sgl.core.server_args import ServerArgs
from sgl.kernels import triton_runs_on
from sgl.kernels.attention import AttentionBackend
from sgl.kernels.fp8_linear import fp8_supported
from sgl.kernels.torch_attention import TorchAttentionBackend
from sgl.sched.batch import ScheduleBatch
from sgl.sched.models.forward_batch import CausalLM, ForwardBatch
from sgl.sched.models.lora_layers import LoraSpec
from sgl.sched.models.parallel import TPGroup
from sgl.sched.models.pooling import PoolingConfig, pooling_config
from sgl.sched.runner.draft import DraftModel
from sgl.sched.runner.gpu_timeline import GpuTimeline
from sgl.sched.runner.grammar_masks import GrammarFill
from sgl.sched.runner.prefill_graph import PrefillGraphs, supports_pieces
from sgl.sched.runner.prepare import BatchPreparer, PreparedBatch
from sgl.sched.runner.sampling_state import SamplingState
from sgl.sched.runner.step import Step, StepResult
from sgl.sched.runner.weights import WeightManager

if TYPE_CHECKING:
    from sgl.sched.models.lora_adapter import LoraAdapter
    from sgl.sched.models.model_config import AnyConfig
    from sgl.sched.runner.cuda_graph import CudaGraphRunner

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# chunked_prefill_size=None: by GPU memory (GiB, exclusive bound -> tokens), SGLang's
# defaults below 90 GiB; an H200 (141 GB) or larger gets 16384 (vLLM's offline default
# there; SGLang gives an H200 8192): W3 without the prefix cache (537,600 prefill tokens)
# ran 4-5% faster with it on one H200 (benchmarks/RESULTS.md), half as many
# prefill batches for the host to build. Prompt-logprob rows are bounded apart
# (sgl.sched.prefill).
GPU_CHUNK_DEFAULTS = [(20, 2048), (35, 2048), (60, 4096), (90, 8192)]
GPU_CHUNK_LARGEST = 16384
# On CPU: the forward's cost grows linearly with its tokens already (no device to fill),
# so larger chunks gain little throughput, while they stall every decoding request for
# the whole chunk and size the [chunk, V] float32 prompt-logprob rows (2048 x 49152 x 4 B
# = 0.4 GB for the default SmolLM2): SGLang's smallest GPU default.
CPU_CHUNK_DEFAULT = 2048


_OTHER_RANK = "another tensor-parallel rank failed its part of the call (see its log): every rank undid its own"


def resolve_device(args: ServerArgs) -> torch.device:
    """The device a scheduler works on. A GPU with its index (the calling thread's current
    one, which a rank's process set first): `cuda` alone means the current GPU of whichever
    thread uses it, and compares unequal to its tensors' `cuda:N`."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available: pass device='cpu' or run on a GPU machine")
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu" if args.device == "auto" else args.device)


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
        # The LoRA adapters' device slots, in every projection they may change (sgl.sched.lora).
        self.lora_spec = self._lora_spec(args)
        # The Triton LoRA kernels on CUDA where Triton runs, else the torch path (sgl.kernels.lora).
        self.lora_triton = self.lora_spec is not None and triton_runs_on(self.device)
        t0 = time.perf_counter()
        self.model, self.config = self._load(args, model_path)
        self.startup = {"weights_s": time.perf_counter() - t0}
        self.weights = WeightManager(self.model, self.device, self.dtype, tp, args.load_format)
        self.pooling = self._pooling(args, model_path)
        self.vocab_size: int = self.model.vocab_size
        self.eos_ids = frozenset(eos_ids_of(self.config, model_path))
        # Every allowed processor is imported at start-up: a bad entry fails the engine's start.
        self.processors = {name: resolve(name) for name in args.custom_logit_processors}
        # The model's own limit (its rotary table); the null model has none.
        limit: int | None = getattr(self.model, "context_len", None)
        if args.context_length is not None and limit is not None and args.context_length > limit:
            raise ValueError(f"context_length={args.context_length} exceeds the model's {limit}")
        self.context_length = args.context_length or limit or int(getattr(self.config, "max_position_embeddings", 4096))
        self.chunked_prefill_size = chunked_prefill_size(args, self.device)
        m = self.model
        self.kv_dtype = _KV_DTYPES.get(args.kv_cache_dtype, self.dtype)
        # STANDALONE speculation's draft model: loaded before the KV pools, which share the
        # memory left with its own pool (the same slots: its bytes per token count too).
        t0 = time.perf_counter()
        draft = self._load_draft(args)
        if draft is not None:
            self.startup["draft_weights_s"] = time.perf_counter() - t0
        draft_bytes = (0 if draft is None else
                       MHATokenToKVPool.bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim,
                                                        self.kv_dtype))
        slots = args.max_total_tokens
        # Sized here when every rank must hold the same slots (the smallest pool fits all) or a
        # draft's pool shares the memory; else build_kv_pools sizes it.
        if slots is None and (tp.size > 1 or draft is not None):
            slots = tp.min_int(default_kv_tokens(m.num_layers, m.num_kv_heads, m.head_dim, self.kv_dtype,
                                                 self.device, args.mem_fraction_static,
                                                 extra_bytes_per_token=draft_bytes))
        t0 = time.perf_counter()
        pools = build_kv_pools(m.num_layers, m.num_kv_heads, m.head_dim, self.kv_dtype, self.device,
                               self.context_length, slots, args.max_running_requests, args.mem_fraction_static)
        self.startup["kv_pool_s"] = time.perf_counter() - t0
        self.max_total_tokens = pools.max_total_tokens
        self.max_running_requests = pools.max_running_requests
        self.kv_pool = pools.kv_pool
        self.allocator = pools.allocator
        self.req_to_token_pool = pools.req_to_token_pool
        self.attn_backend = self._attention_backend(args, m)
        on = args.enable_cascade_attention
        self.cascade = self.attn_backend.supports_cascade and (
            self.attn_backend.cascade_by_default if on is None else on)
        self.preparer = BatchPreparer(self)
        self.draft: DraftModel | None = None
        if draft is not None:
            self.draft = DraftModel(draft, WeightManager(draft, self.device, self.dtype, tp, args.load_format),
                                    MHATokenToKVPool(self.max_total_tokens, draft.num_layers, draft.num_kv_heads,
                                                     draft.head_dim, self.kv_dtype, self.device),
                                    self._attention_backend(args, draft), self.req_to_token_pool, self.preparer,
                                    min(self.vocab_size, draft.vocab_size), self.dtype,
                                    args.speculative_num_draft_tokens)
        self.sampling = SamplingState(self.device, self.req_to_token_pool.size, self.vocab_size, self.dtype,
                                      args.random_seed or 0, self.eos_ids, self.processors,
                                      masks=args.grammar_backend != "none", tp=tp)
        self.gpu_timeline = GpuTimeline()
        self.graphs: CudaGraphRunner | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.prefill_graph_steps = 0  # batches run through the prefill graphs (server info)
        self.prefill_whole_graph_steps = 0  # of them, through a whole-forward graph
        # The null model never attends: its batches need no KV indices and no attention plan.
        self.attends = args.load_format != "null"
        graphed = self.device.type == "cuda" and not args.disable_cuda_graph and self.attends
        # The largest batch the CUDA graphs take; None: no graphs.
        self.graph_bs = min(args.cuda_graph_max_bs, self.max_running_requests) if graphed else None
        # The largest extend batch (in tokens) the piecewise graphs take; None: none. Never
        # beyond a prefill chunk; not the target's with LoRA adapters (their rows change every
        # batch), a draft's all the same (adapters never apply to it).
        pieces = args.piecewise_cuda_graph_max_tokens
        piece_tokens = min(pieces, self.chunked_prefill_size or pieces) if graphed and pieces > 0 else None
        self.prefill_graph_tokens = piece_tokens if self.lora_spec is None and supports_pieces(self.model) else None
        self.draft_graph_tokens = piece_tokens
        t0 = time.perf_counter()
        self._capture_graphs()
        self.startup["cuda_graphs_s"] = time.perf_counter() - t0
        # The last memory release's and resume's seconds (resume's graph capture apart).
        self.memory_stats: dict[str, float] = {}
        self.log.info(
            "model ready", device=str(self.device), dtype=str(self.dtype), kv_tokens=self.max_total_tokens,
            kv_gib=round(self.kv_pool.nbytes() / 2**30, 2), attention=type(self.attn_backend).__name__,
            decode_attention=self.decode_attention,
            context_length=self.context_length, max_running_requests=self.max_running_requests,
            cuda_graph_sizes=self.graphs.sizes if self.graphs else None,
            prefill_graph_tokens=self.prefill_graphs.sizes if self.prefill_graphs else None,
            **{k: round(v, 2) for k, v in self.startup.items()},
        )

    def _capture_graphs(self) -> None:
        if self.graph_bs is not None:
            from sgl.sched.runner.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, self.graph_bs)
        if self.prefill_graph_tokens is not None:
            self.prefill_graphs = PrefillGraphs(self, self.prefill_graph_tokens)
        if self.draft is not None and self.graph_bs is not None:
            self.draft.capture(self.graph_bs, self.draft_graph_tokens)

    def _drop_graphs(self) -> None:
        """Drop every CUDA graph (the target's and a draft's): they read the memory a release frees."""
        self.graphs = self.prefill_graphs = None
        if self.draft is not None:
            self.draft.drop_graphs()

    # ---- memory release, for a trainer sharing the device ----

    @property
    def released(self) -> frozenset[str]:
        """The memory tags whose device memory is released."""
        on_device = {"weights": self.weights.resident, "kv_cache": not self.kv_pool.released}
        return frozenset(t for t in MEMORY_TAGS if not on_device[t])

    def _holders(self, tags: list[str]) -> MemoryHolders:
        """What holds the tags' memory (a draft model's part too), in the tags' order."""
        d = self.draft
        parts: dict[str, list[WeightManager | MHATokenToKVPool]] = {
            "weights": [self.weights, *([d.weights] if d else [])],
            "kv_cache": [self.kv_pool, *([d.kv_pool] if d else [])]}
        return MemoryHolders(self.tp, *(h for t in tags for h in parts[t]))

    def _tags(self, tags: set[str], released: bool) -> list[str]:
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise ValueError(f"unknown memory tag {', '.join(map(repr, unknown))}; tags are {', '.join(MEMORY_TAGS)}")
        wrong = [t for t in MEMORY_TAGS if t in tags and (t in self.released) != released]
        if wrong:
            raise ValueError(f"memory tag {', '.join(map(repr, wrong))} is "
                             + ("not released" if released else "released already"))
        return [t for t in MEMORY_TAGS if t in tags]

    def release_memory(self, tags: set[str]) -> None:
        """Free the device memory of the tagged parts ("weights": kept in host memory;
        "kv_cache": its content is lost, so the radix cache must be flushed first) and
        drop the CUDA graphs, which read them. Call with no batch in flight. On failure
        nothing is released."""
        todo = self._tags(tags, released=False)
        t0 = time.perf_counter()
        self._holders(todo).release()
        if self.graphs is not None or self.prefill_graphs is not None:
            self._drop_graphs()
            gc.collect()  # the graphs' memory pool goes with its last graph
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.memory_stats["release_s"] = time.perf_counter() - t0
        self.log.info("memory released", tags=todo, released=sorted(self.released),
                      seconds=round(self.memory_stats["release_s"], 3))

    def resume_memory(self, tags: set[str]) -> None:
        """Allocate the tagged parts again (the weights' values come back, the KV cache
        is empty); once nothing is released the CUDA graphs are captured again. On
        failure (out of memory) the tags stay released, on every tensor-parallel rank:
        a capture that failed on one rank is undone on all (MemoryHolders' rule)."""
        todo = self._tags(tags, released=True)
        t0 = time.perf_counter()
        holders = self._holders(todo)
        holders.resume()
        self.memory_stats["resume_s"] = time.perf_counter() - t0
        failure: BaseException | None = None
        if not self.released and self.graphs is None and self.graph_bs is not None:
            t1 = time.perf_counter()
            try:
                self._capture_graphs()
                self.memory_stats["recapture_s"] = time.perf_counter() - t1
            except BaseException as e:  # noqa: BLE001 - raised below, once the ranks agree
                failure = e
        # Asked by every rank, captured or not: the ranks ask in step.
        if not self.tp.all_ok(failure is None):
            self._drop_graphs()
            holders.release()
            raise failure or RuntimeError(_OTHER_RANK)
        self.log.info("memory resumed", tags=todo, released=sorted(self.released),
                      seconds=round(self.memory_stats["resume_s"], 3))

    @property
    def decode_attention(self) -> str:
        """Plain decode's kernel: "triton", "flashinfer", or "torch"."""
        b = self.attn_backend
        return "torch" if not hasattr(b, "triton_decode") else "triton" if b.triton_decode else "flashinfer"

    def _attention_backend(self, args: ServerArgs, m: CausalLM) -> AttentionBackend:
        """An attention backend for model `m` (the target, or the draft: their shapes may differ)."""
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
        return FlashInferAttentionBackend(m.num_heads, m.num_kv_heads, m.head_dim, self.dtype, self.device,
                                          self.max_total_tokens + 1, context_length=self.context_length,
                                          tensor_core_min_batch=args.tensor_core_decode_min_batch,
                                          kv_dtype=self.kv_dtype, triton_decode=triton)

    def _load(self, args: ServerArgs, model_path: str) -> tuple[CausalLM, AnyConfig]:
        if args.load_format == "null":
            from sgl.sched.models.loader import hf_config
            from sgl.sched.models.null import DeviceTime, NullModel

            if args.quantization is not None:
                raise ValueError(f"quantization={args.quantization!r} quantizes a model's weights, and "
                                 "load_format='null' runs the null model, which has none: leave quantization unset")

            config = hf_config(Path(model_path), args.trust_remote_code)
            timing = DeviceTime.from_config(getattr(config, DeviceTime.CONFIG_KEY, None))
            return NullModel(config.vocab_size, self.device, timing), config
        from sgl.sched.models.loader import load_model

        if args.quantization is not None and (why := fp8_supported(self.device)) is not None:
            raise ValueError(why)
        model, config = load_model(model_path, args.load_format, self.dtype, self.device,
                                   seed=args.random_seed or 0, tp=self.tp, lora=self.lora_spec,
                                   quantization=args.quantization)
        return model, config  # in eval mode already

    def _load_draft(self, args: ServerArgs) -> CausalLM | None:
        """STANDALONE's draft model (None without one), in the target's dtype on its device."""
        path = args.speculative_draft_model_path
        if path is None:
            return None
        if args.load_format == "null":
            raise ValueError("speculative_algorithm='STANDALONE' needs real weights: the null model "
                             "(load_format='null') has nothing to verify proposals with")
        if not Path(path).is_dir():
            raise ValueError(f"speculative_draft_model_path={path!r} is not a directory: pass a Hugging Face model "
                             "directory whose tokenizer is the target's")
        from sgl.sched.models.loader import load_model

        model, _ = load_model(path, "auto" if args.load_format == "gguf" else args.load_format, self.dtype,
                              self.device, seed=args.random_seed or 0)
        limit = getattr(model, "context_len", None)
        if limit is not None and limit < self.context_length:
            raise ValueError(f"the draft model's context ({limit} tokens) is shorter than context_length "
                             f"({self.context_length}): pass context_length={limit} or a draft with a longer context")
        return model

    def _lora_spec(self, args: ServerArgs) -> LoraSpec | None:
        if not args.lora_enabled:
            return None
        if args.load_format == "null":
            raise ValueError("LoRA adapters need a real model: the null model (load_format='null') has no projections")
        return LoraSpec.from_args(args)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a device slot, after the forwards queued so far (which may
        read the slot's previous adapter) and before the next."""
        self._submit(self.model.load_lora, slot, adapter.weights)  # type: ignore[attr-defined]

    def _pooling(self, args: ServerArgs, model_path: str) -> PoolingConfig | None:
        """How embedding requests pool (None: the model serves none; sgl.sched.models.pooling)."""
        if args.load_format == "null":
            if args.is_embedding:
                raise ValueError("is_embedding: the null model (load_format='null') has no hidden states to pool")
            return None
        path = Path(model_path)
        return pooling_config(path if path.is_dir() else path.parent, self.config, args.is_embedding, args.pooling)

    def prepare(self, batch: ScheduleBatch) -> PreparedBatch:
        """Host side, at build time: every tensor the forward needs, copied from the
        request state so that the scheduler may change it while the batch runs.
        Nothing here waits for the device (sgl.sched.runner.prepare), except a draft
        model's proposals for grammar requests (sgl.sched.runner.draft); a draft's forwards
        come first, their proposals the step's inputs."""
        proposals = started = None
        if batch.drafts:
            assert self.draft is not None
            started = self._gpu_event()  # the step's GPU work begins with the draft's forwards
            proposals = self.draft.propose(batch)
        prepared = self.preparer.prepare(batch, proposals)
        prepared.started = started
        return prepared

    def launch(self, p: PreparedBatch) -> Step:
        """Queue a prepared batch's forward and, unless it has grammar rows, its sampling
        (sgl.sched.runner.step.Step). On CUDA the kernels are queued and the results come
        back through pinned buffers and an event, so the caller works on while the GPU
        runs (the overlap loop needs no thread there); on a CPU with the overlap loop
        they run on the worker thread, else right away."""
        start = p.started if p.started is not None else self._gpu_event()
        return Step(self, p, self._submit(self._logits, p), start)

    def _gpu_event(self) -> torch.cuda.Event | None:
        """On CUDA, a timing event queued now (where the GPU work queued next begins)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def queue_sampling(self, p: PreparedBatch, logits: Future[torch.Tensor],
                       fill: GrammarFill | None) -> tuple[Future[StepResult], torch.cuda.Event | None]:
        """Queue a launched batch's sampling after its forward: its host results to come,
        and on CUDA the event that marks them copied."""
        table = self.req_to_token_pool.mirror
        if self.device.type != "cuda":
            return self._submit(lambda: self._sample(p, logits, fill, table).to_host(False)), None
        step = self._sample(p, logits, fill, table).to_host(non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        return _done(step), done

    def _sample(self, p: PreparedBatch, logits: Future[torch.Tensor], fill: GrammarFill | None,
                table: torch.Tensor) -> StepResult:
        """A batch's sampling once its forward is queued, with the rows it pooled."""
        res = self.sampling.sample(p, logits.result(), fill, table)
        if p.pool is not None:
            res.pooled = p.pool.out
        return res

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Device work in launch order: on the worker thread where there is one, else now."""
        if self.worker is not None:
            return self.worker.submit(fn, *args)
        return _done(fn(*args))

    def info(self) -> dict[str, Any]:
        """The runner's part of the scheduler's server info."""
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
                "quantization": getattr(self.model, "quantization", None), "decode_attention": self.decode_attention,
                "vocab_size": self.vocab_size, "context_length": self.context_length,
                "max_total_tokens": self.max_total_tokens, "max_running_requests": self.max_running_requests,
                "eos_token_ids": sorted(self.eos_ids), "cascade_steps": self.preparer.cascade_steps,
                "prefill_graph_steps": self.prefill_graph_steps,
                "prefill_whole_graph_steps": self.prefill_whole_graph_steps,
                "startup": self.startup, "memory": self.memory_stats,
                "embedding": None if self.pooling is None else self.pooling.info(),
                **(self.draft.info() if self.draft is not None else {}),
                **self.gpu_timeline.info(), **self.sampling.masks.times}

    def close(self) -> None:
        """Stop the runner's threads (the forward worker, the grammar fill threads)."""
        if self.worker is not None:
            self.worker.shutdown(wait=False, cancel_futures=True)
        self.sampling.close()
        self.weights.close()

    @torch.inference_mode()
    def _logits(self, p: PreparedBatch) -> torch.Tensor:
        """Queue one batch's forward: the logits rows it computes, on the device."""
        # Decode inputs are the tokens the previous step sampled, still on the device.
        input_ids = self.sampling.next_token[p.rows] if p.input_ids is None else p.input_ids
        if p.proposals is not None:
            input_ids[p.proposals[0]] = p.proposals[1]
        if p.batch.device_inputs:  # entries whose tokens are on the device (-1 in the host's inputs)
            src = p.rows if p.input_rows is None else p.input_rows
            input_ids = torch.where(input_ids < 0, self.sampling.next_token[src], input_ids)
        if p.attn.is_decode and self.graphs is not None and self.graphs.can_run(len(p.attn.qo_lens)):
            return self.graphs.replay(p.attn, input_ids, p.positions, p.out_cache_loc, p.lora)
        fb = ForwardBatch(
            input_ids=input_ids,
            positions=p.positions,
            out_cache_loc=p.out_cache_loc,
            logits_indices=p.logits_indices,
            attn=p.attn,
            attn_backend=self.attn_backend,
            kv_pool=self.kv_pool,
            pool=p.pool,
            lora=p.lora,
        )
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(input_ids.shape[0]):
            logits, whole = self.prefill_graphs.forward(input_ids, fb)  # plans the attention itself
            self.prefill_graph_steps += 1
            self.prefill_whole_graph_steps += whole
            return logits
        if self.attends:
            self.attn_backend.begin_forward(p.attn)
        return self.model(fb)


class MemoryHolders:
    """The holders of memory tags (the target's, and a draft model's), released and resumed
    together, on every tensor-parallel rank or on none: when one fails, here or on another
    rank, those done already are undone (a rank that went on alone would capture graphs,
    or run forwards, whose collectives the others never join)."""

    def __init__(self, tp: TPGroup, *holders: WeightManager | MHATokenToKVPool) -> None:
        self.tp = tp
        self.holders = holders

    def release(self) -> None:
        self._all("release", "resume")

    def resume(self) -> None:
        self._all("resume", "release")

    def _all(self, do: str, undo: str) -> None:
        done: list[WeightManager | MHATokenToKVPool] = []
        failure: BaseException | None = None
        try:
            for h in self.holders:
                getattr(h, do)()
                done.append(h)
        except BaseException as e:  # noqa: BLE001 - raised below, once the ranks agree
            failure = e
        if not self.tp.all_ok(failure is None):
            for h in reversed(done):
                getattr(h, undo)()
            raise failure or RuntimeError(_OTHER_RANK)


def _done(value: T) -> Future[T]:
    f: Future[T] = Future()
    f.set_result(value)
    return f
