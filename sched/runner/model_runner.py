"""ModelRunner: owns the model, the KV pools and the attention backend; turns a
ScheduleBatch into a ForwardBatch, runs the forward and samples.

It decides nothing about which requests run: that is the scheduler's job."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import AutoConfig, PretrainedConfig

from sgl.cache.host_copy import pinned, to_device
from sgl.cache.kv_allocator import TokenToKVPoolAllocator
from sgl.cache.kv_pool import MHATokenToKVPool
from sgl.cache.req_to_token_pool import ReqToTokenPool, gather_kv_indices
from sgl.core.log import get_logger
from sgl.core.logit_processor import CustomLogitProcessor
from sgl.core.server_args import ServerArgs
from sgl.kernels.attention import AttentionBackend, AttnMetadata, CascadeMeta
from sgl.kernels.torch_attention import TorchAttentionBackend
from sgl.sched.batch import ScheduleBatch
from sgl.sched.models.forward_batch import ForwardBatch
from sgl.sched.runner.sampler import SamplingBatch, process_logits, sample

if TYPE_CHECKING:
    from sgl.sched.runner.cuda_graph import CudaGraphRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_TOKENS = 65536
DEFAULT_GPU_MEM_FRACTION = 0.8
# A decode batch goes through cascade attention when the shared prefix P of its B
# requests makes P * (B - 1) >= this many token reads fewer per layer: enough KV
# traffic (~0.13 GB, ~30 us per layer for 8 KV heads of 128 in bf16) to pay for the
# extra kernel and the merge (~15 us per layer on an H200 at batch 256).
CASCADE_MIN_SAVED_TOKENS = 32768


def resolve_device(args: ServerArgs) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available: pass device='cpu' or run on a GPU machine")
    return torch.device(args.device)


def resolve_dtype(args: ServerArgs, device: torch.device) -> torch.dtype:
    if args.dtype != "auto":
        return _DTYPES[args.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str) -> None:
        self.log = get_logger("scheduler")
        self.device = resolve_device(args)
        off = args.disable_overlap_schedule
        self.overlap = self.device.type == "cuda" if off is None else not off
        # The CPU overlap loop runs each forward on this thread; CUDA queues kernels instead.
        self.worker = (ThreadPoolExecutor(1, thread_name_prefix="sgl-forward")
                       if self.device.type == "cpu" and self.overlap else None)
        self.dtype = resolve_dtype(args, self.device)
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        self.model, self.config = self._load(args, model_path)
        self.vocab_size: int = self.model.vocab_size
        # The model's own limit (its rotary table); the null model has none.
        limit: int | None = getattr(self.model, "context_len", None)
        if args.context_length is not None and limit is not None and args.context_length > limit:
            raise ValueError(f"context_length={args.context_length} exceeds the model's {limit}")
        self.context_length = args.context_length or limit or int(getattr(self.config, "max_position_embeddings", 4096))
        self.max_total_tokens = args.max_total_tokens or self._default_kv_tokens(args)
        self.max_running_requests = args.max_running_requests or min(256, self.max_total_tokens)
        m = self.model
        self.kv_pool = MHATokenToKVPool(
            self.max_total_tokens, m.num_layers, m.num_kv_heads, m.head_dim, self.dtype, self.device
        )
        # Slot bookkeeping lives on the host: the scheduler decides there. The forward
        # builds its KV indices on the device from the table's mirror, which each batch
        # brings up to date with the rows' changed ranges (one pinned copy, never a sync).
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, "cpu")
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_length + 1, self.device)
        self.attn_backend = self._attention_backend(args)
        on = args.enable_cascade_attention
        self.cascade = self.attn_backend.supports_cascade and (
            self.attn_backend.cascade_by_default if on is None else on)
        self._shared: tuple[tuple, int] = ((), 0)  # (decode batch identity, its shared prefix length)
        self._sampling: tuple[tuple, SamplingBatch | None] = ((), None)  # (decode batch identity, its sampling)
        self.cascade_steps = 0
        # The future-token buffer: the last sampled token of each request row.
        self.next_token = torch.zeros(self.max_running_requests, dtype=torch.int64, device=self.device)
        # Output-token counts per request row for penalties: allocated when first needed,
        # each penalised row rewritten from the host at its (re-)prefill, advanced per step.
        self.counts: torch.Tensor | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self.processors: dict[str, CustomLogitProcessor] = {}
        self.generator = torch.Generator(self.device)
        self.generator.manual_seed(args.random_seed if args.random_seed is not None else 0)
        self.gpu_timeline = GpuTimeline()
        self.graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not args.disable_cuda_graph and args.load_format != "null":
            from sgl.sched.runner.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, min(args.cuda_graph_max_bs, self.max_running_requests))
        self.log.info(
            "model ready", device=str(self.device), dtype=str(self.dtype), kv_tokens=self.max_total_tokens,
            kv_gib=round(self.kv_pool.nbytes() / 2**30, 2), attention=type(self.attn_backend).__name__,
            context_length=self.context_length, max_running_requests=self.max_running_requests,
            cuda_graph_sizes=self.graphs.sizes if self.graphs else None,
        )

    def _attention_backend(self, args: ServerArgs) -> AttentionBackend:
        choice = args.attention_backend
        if choice == "auto":
            choice = "flashinfer" if self.device.type == "cuda" and self.dtype != torch.float32 else "torch"
        if choice == "torch" or args.load_format == "null":
            return TorchAttentionBackend()
        if self.device.type != "cuda":
            raise ValueError("attention_backend='flashinfer' needs a CUDA device: pass attention_backend='torch'")
        from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

        m = self.model
        return FlashInferAttentionBackend(m.num_heads, m.num_kv_heads, m.head_dim, self.dtype, self.device,
                                          self.max_total_tokens + 1)

    def _load(self, args: ServerArgs, model_path: str) -> tuple[torch.nn.Module, PretrainedConfig]:
        if args.load_format == "null":
            from sgl.sched.models.null import NullModel

            config = AutoConfig.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
            return NullModel(config.vocab_size, self.device), config
        from sgl.sched.models.loader import load_model

        model, config = load_model(model_path, args.load_format, self.dtype, self.device,
                                   seed=args.random_seed or 0)
        return model.eval(), config

    def _default_kv_tokens(self, args: ServerArgs) -> int:
        m = self.model
        per_token = MHATokenToKVPool.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, self.dtype)
        if self.device.type == "cuda":
            # SGLang's meaning: the KV pool takes this fraction of what the weights left free;
            # the rest holds activations, logits and CUDA graphs.
            free, _ = torch.cuda.mem_get_info(self.device)
            frac = args.mem_fraction_static or DEFAULT_GPU_MEM_FRACTION
            return max(1, int(free * frac) // per_token)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return max(1, min(DEFAULT_CPU_KV_TOKENS, int(ram * 0.2) // per_token))

    def prepare(self, batch: ScheduleBatch) -> PreparedBatch:
        """Host side, at build time: every tensor the forward needs, copied from the
        request state so that the scheduler may change it while the batch runs.
        Nothing here waits for the device."""
        dev = self.device
        qo_indptr = self._host(indptr_of(batch.qo_lens))
        kv_indptr = self._host(indptr_of(batch.kv_lens))
        rows = torch.tensor(batch.rows, dtype=torch.int64)
        kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int64)
        self.req_to_token_pool.sync()
        rows_dev, kv_lens_dev = self._dev(rows), self._dev(kv_lens)
        zeros = torch.zeros_like(rows_dev)
        # A decode batch of the same requests in the same rows as the last one (the common
        # case: nothing joined, finished or was retracted) reuses what depends on them alone.
        key = (tuple(batch.rows), tuple(r.rid for r in batch.reqs), tuple(batch.epochs)) if batch.is_decode else ()
        cascade = self._cascade(batch, key, rows, rows_dev, kv_lens, kv_lens_dev) if key and self.cascade else None
        table = self.req_to_token_pool.mirror
        meta = AttnMetadata(
            is_decode=batch.is_decode,
            qo_indptr=self._dev(qo_indptr),
            kv_indptr=self._dev(kv_indptr),
            kv_indices=(gather_kv_indices(table, rows_dev, zeros, kv_lens_dev, int(kv_indptr[-1]))
                        if cascade is None else torch.empty(0, dtype=torch.int32, device=dev)),
            qo_lens=batch.qo_lens,
            kv_lens=batch.kv_lens,
            kv_indptr_host=kv_indptr,
            qo_indptr_host=qo_indptr,
            cascade=cascade,
        )
        prefix_lens = [k - q for k, q in zip(batch.kv_lens, batch.qo_lens)]
        if not batch.is_decode and any(prefix_lens):
            prefix_indptr = self._host(indptr_of(prefix_lens))
            plens = torch.tensor(prefix_lens, dtype=torch.int64)
            meta.prefix_indptr_host = prefix_indptr
            meta.prefix_lens_host = self._host(plens.to(torch.int32))
            meta.prefix_indices = gather_kv_indices(table, rows_dev, zeros, self._dev(plens), int(prefix_indptr[-1]))
        ids = None if batch.input_ids is None else self._dev(torch.tensor(batch.input_ids, dtype=torch.int64))
        reqs = batch.reqs
        same = self._sampling[1] if key and self._sampling[0] == key else None
        sampling = SamplingBatch.from_reqs(reqs, self.vocab_size, dev, self.eos_ids, self.processors, batch.is_decode,
                                           same_as=same)
        self._sampling = (key, sampling if key else None)
        logits_rows = qo_indptr[1:] - 1
        sample_rows = None
        lp = None
        if any(r.return_logprob for r in reqs):
            idx: list[int] = []
            targets: list[int] = []
            for i, (r, (a, k)) in enumerate(zip(reqs, batch.lp_in)):
                base = int(qo_indptr[i]) - (batch.kv_lens[i] - batch.qo_lens[i])  # packed row of position 0
                idx.extend(range(base + a, base + a + k))
                targets.extend(r.origin_input_ids[a + 1 : a + 1 + k])
                idx.append(int(qo_indptr[i + 1]) - 1)
                targets.append(0)  # the sampled token, filled in on the device
            logits_rows = torch.tensor(idx, dtype=torch.int64)
            sample_rows = torch.tensor([k for _, k in batch.lp_in], dtype=torch.int64).add_(1).cumsum_(0).sub_(1)
            m = max((len(r.token_ids_logprob or ()) for r in reqs), default=0)
            id_rows = None
            if m:
                # Each row of a request asks for that request's ids (padded with id 0, dropped on the host).
                per_req = [(r.token_ids_logprob or []) + [0] * (m - len(r.token_ids_logprob or [])) for r in reqs]
                counts = [k + 1 for _, k in batch.lp_in]
                id_rows = self._dev(torch.tensor([row for row, c in zip(per_req, counts) for _ in range(c)]))
            lp = LogprobPlan(self._dev(torch.tensor(targets, dtype=torch.int64)),
                             max(r.top_logprobs_num for r in reqs), id_rows)
        if sampling.penalties is not None and self.counts is None:
            self.counts = torch.zeros(self.req_to_token_pool.size, self.vocab_size, dtype=torch.int32, device=dev)
        reset = None
        if sampling.penalties is not None and not batch.is_decode:
            pen = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties]
            pairs = [(batch.rows[i], t) for i in pen for t in reqs[i].output_ids]
            reset = (self._dev(torch.tensor([batch.rows[i] for i in pen], dtype=torch.int64)),
                     self._dev(torch.tensor([q[0] for q in pairs], dtype=torch.int64)),
                     self._dev(torch.tensor([q[1] for q in pairs], dtype=torch.int64)))
        return PreparedBatch(
            rows=rows_dev,
            input_ids=ids,
            positions=self._dev(batch.positions),
            out_cache_loc=self._dev(batch.out_cache_loc),
            logits_indices=self._dev(logits_rows.to(torch.int64)),
            sample_rows=None if sample_rows is None else self._dev(sample_rows),
            attn=meta,
            sampling=sampling,
            logprobs=lp,
            counts_reset=reset,
        )

    def _cascade(self, batch: ScheduleBatch, key: tuple, rows: torch.Tensor, rows_dev: torch.Tensor,
                 kv_lens: torch.Tensor, kv_lens_dev: torch.Tensor) -> CascadeMeta | None:
        """The shared-prefix split of a decode batch when reading the prefix once saves
        enough (see CASCADE_MIN_SAVED_TOKENS), else None. The prefix length is cached per
        batch identity: a running request's first slots never change while it decodes."""
        b = len(batch.rows)
        if b < 2:
            return None
        if self._shared[0] != key:
            self._shared = (key, shared_prefix_len(self.req_to_token_pool.req_to_token, rows, int(kv_lens.min()) - 1))
        p = self._shared[1]
        if p * (b - 1) < CASCADE_MIN_SAVED_TOKENS:
            return None
        table = self.req_to_token_pool.mirror
        self.cascade_steps += 1
        own = kv_lens - p
        indptr = self._host(indptr_of(own.tolist()))
        return CascadeMeta(p, table[batch.rows[0], :p].clone(), indptr,
                           gather_kv_indices(table, rows_dev, torch.full_like(rows_dev, p), kv_lens_dev - p,
                                             int(indptr[-1])), (key, p))

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return pinned(t, self.device)

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)

    def launch(self, p: PreparedBatch) -> Launched:
        """Start a prepared batch; `.result()` of the returned handle gives its StepResult
        on the host. On CUDA the kernels are queued and the results come back through
        pinned buffers and an event, so the caller works on while the GPU runs (the
        overlap loop needs no thread there). On CPU the forward runs on the worker
        thread when there is one, else right away."""
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            step = self._forward(p).to_host(non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            return _CudaLaunched(step, start, done, self.gpu_timeline, p.attn.is_decode)
        if self.worker is not None:
            return self.worker.submit(self.execute, p)
        return _Ready(self.execute(p))

    def execute(self, p: PreparedBatch) -> StepResult:
        """Run one prepared batch to completion; its results on the host."""
        return self._forward(p).to_host(non_blocking=False)

    @torch.inference_mode()
    def _forward(self, p: PreparedBatch) -> StepResult:
        """Queue one batch: the sampled next token of each request and, when asked,
        logprobs (log_softmax of the raw logits, before bias, penalties and
        temperature), as device tensors."""
        # Decode inputs are the tokens the previous step sampled, still on the device.
        input_ids = self.next_token[p.rows] if p.input_ids is None else p.input_ids
        if p.attn.is_decode and self.graphs is not None and self.graphs.can_run(len(p.attn.qo_lens)):
            all_logits = self.graphs.replay(p, input_ids)
        else:
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
            all_logits = self.model(fb)

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
        next_ids = sample(process_logits(logits, p.sampling, counts, errors), p.sampling, self.generator)
        self.next_token[p.rows] = next_ids
        if self.counts is not None:
            self.counts[p.rows, next_ids] += 1
        out = StepResult(next_ids, errors=errors)
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


@dataclass(slots=True)
class LogprobPlan:
    targets: torch.Tensor  # [R] the token each logits row scores (sampled rows filled in at run time)
    top_k: int
    id_rows: torch.Tensor | None  # [R, M] token_ids_logprob per row


@dataclass(slots=True)
class StepResult:
    next_ids: torch.Tensor  # [B]
    # Per logits row [R] (request i's rows end at its sampled row); None unless asked.
    token: torch.Tensor | None = None
    top_vals: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    ids_vals: torch.Tensor | None = None
    errors: dict[int, str] | None = None  # batch row -> why its request must be aborted

    def to_host(self, non_blocking: bool) -> StepResult:
        """The same results as host tensors; pinned and not yet valid until the device
        work is done when non_blocking (the caller waits on an event)."""

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device.type == "cpu":
                return t
            if not non_blocking:
                return t.cpu()
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return StepResult(host(self.next_ids), host(self.token), host(self.top_vals), host(self.top_ids),  # type: ignore[arg-type]
                          host(self.ids_vals), self.errors)


class GpuTimeline:
    """GPU busy and idle time between consecutive batches, from event pairs read once
    each batch's result is in: idle is the gap between one batch's end and the next
    one's start on the GPU, i.e. time the GPU waited for the host. The gaps between
    two decode steps are also summed apart (`decode_idle_s`, against `decode_busy_s`):
    that is where the overlap loop must keep the GPU fed."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.decode_busy_s = 0.0
        self.decode_idle_s = 0.0
        self._prev: tuple[torch.cuda.Event, bool] | None = None  # the last batch's end, and was it decode

    def record(self, start: torch.cuda.Event, done: torch.cuda.Event, decode: bool) -> None:
        """Both events have completed (the caller synchronised on `done`)."""
        busy = start.elapsed_time(done) / 1000
        self.busy_s += busy
        if decode:
            self.decode_busy_s += busy
        if self._prev is not None:
            gap = max(0.0, self._prev[0].elapsed_time(start) / 1000)
            self.idle_s += gap
            if decode and self._prev[1]:
                self.decode_idle_s += gap
        self._prev = (done, decode)

    def reset_gap(self) -> None:
        """The scheduler went idle on purpose: the next gap is not the host's lateness."""
        self._prev = None


class Launched(Protocol):
    def result(self) -> StepResult: ...


class _Ready:
    __slots__ = ("step",)

    def __init__(self, step: StepResult) -> None:
        self.step = step

    def result(self) -> StepResult:
        return self.step


class _CudaLaunched:
    __slots__ = ("step", "start", "done", "timeline", "decode")

    def __init__(self, step: StepResult, start: torch.cuda.Event, done: torch.cuda.Event,
                 timeline: GpuTimeline, decode: bool) -> None:
        self.step, self.start, self.done, self.timeline, self.decode = step, start, done, timeline, decode

    def result(self) -> StepResult:
        self.done.synchronize()
        self.timeline.record(self.start, self.done, self.decode)
        return self.step


def indptr_of(lens: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32 on the host."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=out[1:])
    return out


def shared_prefix_len(req_to_token: torch.Tensor, rows: torch.Tensor, limit: int) -> int:
    """How many leading slots (at most `limit`) all the given rows have in common."""
    if limit <= 0:
        return 0
    block = req_to_token[rows, :limit]
    differs = (block != block[:1]).any(dim=0)
    return int(differs.int().argmax()) if bool(differs.any()) else limit


@dataclass(slots=True)
class PreparedBatch:
    rows: torch.Tensor
    input_ids: torch.Tensor | None
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    logits_indices: torch.Tensor
    sample_rows: torch.Tensor | None  # [B] each request's sampled row among the logits rows (logprobs only)
    attn: AttnMetadata
    sampling: SamplingBatch
    logprobs: LogprobPlan | None
    counts_reset: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, (row, id) pairs to count
