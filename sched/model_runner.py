"""ModelRunner: owns the model, the KV pools and the attention backend; turns a
ScheduleBatch into a ForwardBatch, runs the forward and samples.

It decides nothing about which requests run: that is the scheduler's job."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from sgl.cache.kv_allocator import TokenToKVPoolAllocator
from sgl.cache.kv_pool import MHATokenToKVPool
from sgl.cache.req_to_token_pool import ReqToTokenPool
from sgl.kernels.attention import AttnMetadata
from sgl.kernels.torch_attention import TorchAttentionBackend
from sgl.log import get_logger
from sgl.sched.batch import ScheduleBatch
from sgl.sched.forward_batch import ForwardBatch
from sgl.logit_processor import CustomLogitProcessor
from sgl.sched.sampler import SamplingBatch, process_logits, sample
from sgl.server_args import ServerArgs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_TOKENS = 65536


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
        self.dtype = resolve_dtype(args, self.device)
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        self.model, self.config = self._load(args, model_path)
        self.vocab_size: int = self.model.vocab_size
        self.context_length = args.context_length or int(getattr(self.config, "max_position_embeddings", 4096))
        self.max_total_tokens = args.max_total_tokens or self._default_kv_tokens()
        self.max_running_requests = args.max_running_requests or min(256, self.max_total_tokens)
        m = self.model
        self.kv_pool = MHATokenToKVPool(
            self.max_total_tokens, m.num_layers, m.num_kv_heads, m.head_dim, self.dtype, self.device
        )
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, self.device)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_length + 1, self.device)
        self.attn_backend = TorchAttentionBackend()
        # The future-token buffer: the last sampled token of each request row.
        self.next_token = torch.zeros(self.max_running_requests, dtype=torch.int64, device=self.device)
        # Output-token counts per request row for penalties: allocated when first needed,
        # each penalised row rewritten from the host at its (re-)prefill, advanced per step.
        self.counts: torch.Tensor | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self.processors: dict[str, CustomLogitProcessor] = {}
        self.generator = torch.Generator(self.device)
        self.generator.manual_seed(args.random_seed if args.random_seed is not None else 0)
        self.log.info(
            "model ready", device=str(self.device), dtype=str(self.dtype), kv_tokens=self.max_total_tokens,
            context_length=self.context_length, max_running_requests=self.max_running_requests,
        )

    def _load(self, args: ServerArgs, model_path: str) -> tuple[torch.nn.Module, PretrainedConfig]:
        if args.load_format == "null":
            from sgl.sched.models.null import NullModel

            config = AutoConfig.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
            return NullModel(config.vocab_size, self.device), config
        from sgl.sched.models.loader import load_model

        model, config = load_model(model_path, args.load_format, self.dtype, self.device,
                                   seed=args.random_seed or 0)
        return model.eval(), config

    def _default_kv_tokens(self) -> int:
        m = self.model
        per_token = MHATokenToKVPool.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * 0.85) // per_token)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return max(1, min(DEFAULT_CPU_KV_TOKENS, int(ram * 0.2) // per_token))

    def prepare(self, batch: ScheduleBatch) -> PreparedBatch:
        """Host side, at build time: every tensor the forward needs, copied from the
        request state so that the scheduler may change it while the batch runs."""
        dev = self.device
        qo = torch.tensor(batch.qo_lens, dtype=torch.int32)
        kv = torch.tensor(batch.kv_lens, dtype=torch.int32)
        qo_indptr = torch.zeros(len(qo) + 1, dtype=torch.int32)
        kv_indptr = torch.zeros(len(kv) + 1, dtype=torch.int32)
        torch.cumsum(qo, 0, out=qo_indptr[1:])
        torch.cumsum(kv, 0, out=kv_indptr[1:])
        rows = torch.tensor(batch.rows, dtype=torch.int64, device=dev)
        table = self.req_to_token_pool.req_to_token[rows, : max(batch.kv_lens)]
        kv_mask = torch.arange(table.shape[1], device=dev)[None, :] < kv.to(dev)[:, None]
        meta = AttnMetadata(
            is_decode=batch.is_decode,
            qo_indptr=qo_indptr.to(dev),
            kv_indptr=kv_indptr.to(dev),
            kv_indices=table[kv_mask].to(torch.int64),
            qo_lens=batch.qo_lens,
            kv_lens=batch.kv_lens,
        )
        ids = None if batch.input_ids is None else torch.tensor(batch.input_ids, dtype=torch.int64, device=dev)
        reqs = batch.reqs
        sampling = SamplingBatch.from_reqs(reqs, self.vocab_size, dev, self.eos_ids, self.processors, batch.is_decode)
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
                id_rows = torch.tensor([row for row, c in zip(per_req, counts) for _ in range(c)], device=dev)
            lp = LogprobPlan(torch.tensor(targets, dtype=torch.int64, device=dev),
                             max(r.top_logprobs_num for r in reqs), id_rows)
        if sampling.penalties is not None and self.counts is None:
            self.counts = torch.zeros(self.req_to_token_pool.size, self.vocab_size, dtype=torch.int32, device=dev)
        reset = None
        if sampling.penalties is not None and not batch.is_decode:
            pen = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties]
            pairs = [(batch.rows[i], t) for i in pen for t in reqs[i].output_ids]
            reset = (torch.tensor([batch.rows[i] for i in pen], dtype=torch.int64, device=dev),
                     torch.tensor([q[0] for q in pairs], dtype=torch.int64, device=dev),
                     torch.tensor([q[1] for q in pairs], dtype=torch.int64, device=dev))
        return PreparedBatch(
            rows=rows,
            input_ids=ids,
            positions=batch.positions.to(dev),
            out_cache_loc=batch.out_cache_loc.to(dev),
            logits_indices=logits_rows.to(dev, torch.int64),
            sample_rows=None if sample_rows is None else sample_rows.to(dev),
            attn=meta,
            sampling=sampling,
            logprobs=lp,
            counts_reset=reset,
        )

    @torch.inference_mode()
    def execute(self, p: PreparedBatch) -> StepResult:
        """Run one prepared batch (on the overlap worker, or inline); returns the sampled
        next token of each request as a host tensor (the loop's one sync) and, when asked,
        logprobs: log_softmax of the raw logits, before bias, penalties and temperature."""
        # Decode inputs are the tokens the previous step sampled, still on the device.
        input_ids = self.next_token[p.rows] if p.input_ids is None else p.input_ids
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
        out = StepResult(next_ids.cpu(), errors=errors)
        if (lp := p.logprobs) is not None:
            logp = torch.log_softmax(all_logits.float(), dim=-1)
            assert p.sample_rows is not None
            targets = lp.targets.index_put((p.sample_rows,), next_ids)
            out.token = logp.gather(1, targets[:, None])[:, 0].cpu()
            if lp.top_k > 0:
                vals, ids = logp.topk(min(lp.top_k, logp.shape[-1]), dim=-1)
                out.top_vals, out.top_ids = vals.cpu(), ids.cpu()
            if lp.id_rows is not None:
                out.ids_vals = logp.gather(1, lp.id_rows).cpu()
        return out


@dataclass(slots=True)
class LogprobPlan:
    targets: torch.Tensor  # [R] the token each logits row scores (sampled rows filled in at run time)
    top_k: int
    id_rows: torch.Tensor | None  # [R, M] token_ids_logprob per row


@dataclass(slots=True)
class StepResult:
    next_ids: torch.Tensor  # [B] host
    # Per logits row [R] (request i's rows end at its sampled row), host tensors; None unless asked.
    token: torch.Tensor | None = None
    top_vals: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    ids_vals: torch.Tensor | None = None
    errors: dict[int, str] | None = None  # batch row -> why its request must be aborted


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
