"""The sampler: next-token ids from a batch of logits, vectorised over the batch.

Order of operations on the raw logits (logprobs are taken before all of it):
logit_bias (a sparse add), penalties (from each row's output-token counts),
the min_new_tokens mask (EOS and stop ids to -inf), custom logit processors
(one batched call per processor), then greedy rows take the argmax and sampled
rows apply temperature, top-k and top-p (kernels/sampling.py: FlashInfer's
renormalisation kernels on a GPU, a sort otherwise) and min-p, and draw by
inverting each row's cumulative sum at one uniform number: exact for p, blind to
p's scale, and one random number a row (an exponential race needs one per
vocabulary entry: on a CPU, ten times the cost of the softmax and the sum). A request
with a seed draws the uniform of its k-th output token from a generator seeded by
(seed, k): its tokens depend neither on what else is in the batch nor on chunked
prefill, prefix-cache hits or retraction.
On a GPU a batch with no such row and no min-p draws by fused kernels instead
(sgl.kernels.sampling.FusedDraw: the same distribution, one read of each row, on
the engine's own Philox stream).
Nothing here loops over the vocabulary in Python."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from sgl.core.host_copy import to_device
from sgl.core.logit_processor import BEAM_KEY, OUTPUT_IDS_KEY, OUTPUT_LEN_KEY, RID_KEY, CustomLogitProcessor
from sgl.core.sampling_params import SamplingParams
from sgl.kernels.gumbel_draw import Bitmask
from sgl.kernels.sampling import FusedDraw, top_k_top_p
from sgl.sched.req import Req, beam_offsets

TOP_P_LEAST = torch.finfo(torch.float32).tiny  # the least positive float32


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters as tensors, built once per batch on the scheduler thread."""

    all_greedy: bool
    any_greedy: bool
    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B, 1] float32 (1.0 on greedy rows)
    top_k: torch.Tensor  # [B] int64, vocab size where disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    generators: list[torch.Generator | None]
    seeded: bool = False  # whether any row has a generator of its own
    # Penalties: None when no row has any. Counts live in the model runner, indexed by pool row.
    penalties: torch.Tensor | None = None  # [3, B, 1]: frequency, presence, repetition
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    ban: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids set to -inf (min_new_tokens)
    processors: list[tuple[CustomLogitProcessor, torch.Tensor, list[dict[str, Any]]]] | None = None

    @property
    def modifies_logits(self) -> bool:
        return self.penalties is not None or self.bias is not None or self.ban is not None or bool(self.processors)

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device, eos_ids: frozenset[int] = frozenset(),
                  processors: dict[str, CustomLogitProcessor] | None = None, decode_from: int | None = None,
                  same_as: SamplingBatch | None = None, ahead: list[int] | None = None) -> SamplingBatch:
        """decode_from: the first of the entries that step a running request (the others
        are prefills; None: all are).
        same_as: the batch built for the same requests in the same rows (the previous
        decode step): its per-request tensors are reused, since a request's sampling
        parameters never change; what depends on the tokens generated so far is rebuilt.
        ahead: each entry's output position past its request's next (a speculative step's
        rows: row j samples the request's output token len(output_ids) + j)."""
        ps = [r.sampling_params for r in reqs]
        if same_as is not None:
            sb = replace(same_as, generators=[None] * len(reqs), seeded=False, ban=None, processors=None)
        else:
            sb = cls._per_request(ps, vocab_size, device)
        # Tokens generated before this one. Under overlap a decode row's one in-flight batch
        # will add a token; a prefill row's in-flight batches (earlier chunks, or batches
        # made stale by a retraction) never do.
        start = len(reqs) if decode_from is None else decode_from
        done = [len(r.output_ids) + (r.inflight if i >= start else 0) for i, r in enumerate(reqs)]
        if ahead is not None:
            done = [d + j for d, j in zip(done, ahead)]
        for i, (p, k) in enumerate(zip(ps, done)):
            if p.seed is not None and not p.is_greedy:
                sb.generators[i] = torch.Generator(device).manual_seed((p.seed * _SEED_MIX + k) % (1 << 63))
                sb.seeded = True
        banned = [(i, t, 0.0) for i, (p, d) in enumerate(zip(ps, done)) if d < p.min_new_tokens
                  for t in min_tokens_ban(p, eos_ids)]
        if banned:
            rows, ids, _ = _sparse(banned, device)
            sb.ban = (rows, ids)
        if processors and any(r.processor for r in reqs):
            groups: dict[str, list[int]] = {}
            beams = beam_offsets(reqs)
            for i, r in enumerate(reqs):
                if r.processor:
                    groups.setdefault(r.processor, []).append(i)
            sb.processors = [
                (processors[name], to_device(torch.tensor(rows, dtype=torch.int64), device),
                 [_row_params(reqs[i], beams[i], done[i], processors[name].needs_output_ids) for i in rows])
                for name, rows in groups.items()
            ]
        return sb

    @classmethod
    def _per_request(cls, ps: list[SamplingParams], vocab_size: int, device: torch.device) -> SamplingBatch:
        """The tensors fixed by each request's parameters alone."""
        greedy = [p.is_greedy for p in ps]
        top_k = [vocab_size if (p.top_k < 1 or p.top_k > vocab_size) else p.top_k for p in ps]

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), device)

        sb = cls(
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            greedy=dev(greedy, torch.bool),
            temperature=dev([1.0 if g else p.temperature for p, g in zip(ps, greedy)], torch.float32)[:, None],
            top_k=dev(top_k, torch.int64),
            # A top_p past float32's range would round to 0, which keeps no token: the least
            # positive float32 keeps the likeliest alone, as any top_p under its probability does.
            top_p=dev([max(p.top_p, TOP_P_LEAST) for p in ps], torch.float32),
            min_p=dev([p.min_p for p in ps], torch.float32),
            need_top_k=any(k < vocab_size for k in top_k),
            need_top_p=any(p.top_p < 1.0 for p in ps),
            need_min_p=any(p.min_p > 0.0 for p in ps),
            generators=[None] * len(ps),
        )
        if any(p.has_penalties for p in ps):
            pen = [
                [p.frequency_penalty for p in ps],
                [p.presence_penalty for p in ps],
                [p.repetition_penalty for p in ps],
            ]
            sb.penalties = dev(pen, torch.float32)[:, :, None]
        if any(p.logit_bias for p in ps):
            items = [(i, t, v) for i, p in enumerate(ps) for t, v in p.logit_bias.items()]
            sb.bias = _sparse(items, device)
        return sb


def min_tokens_ban(p: SamplingParams, eos_ids: frozenset[int]) -> list[int]:
    """The ids a request may not sample before min_new_tokens: its stop ids, and EOS
    unless it ignores EOS."""
    return list(p.stop_token_ids) if p.ignore_eos else [*p.stop_token_ids, *eos_ids]


def _row_params(r: Req, beam: int, done: int, with_ids: bool) -> dict[str, Any]:
    """A row's processor params: its request's custom_params and the row's state."""
    out = {**(r.sampling_params.custom_params or {}), OUTPUT_LEN_KEY: done, RID_KEY: r.rid}
    if r.beam is not None:
        out[BEAM_KEY] = beam
        if with_ids:
            outputs = r.beam.outputs
            out[OUTPUT_IDS_KEY] = list(outputs[beam] if beam < len(outputs) else outputs[0])
    elif with_ids:
        out[OUTPUT_IDS_KEY] = list(r.output_ids)
    return out


_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, k) pairs over the generator's seed space


def _sparse(
    items: list[tuple[int, int, float]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, ids, vals = zip(*items)
    return (to_device(torch.tensor(rows, dtype=torch.int64), device),
            to_device(torch.tensor(ids, dtype=torch.int64), device),
            to_device(torch.tensor(vals, dtype=torch.float32), device))


def process_logits(logits: torch.Tensor, sb: SamplingBatch, counts: torch.Tensor | None,
                   errors: dict[int, str] | None = None) -> torch.Tensor:
    """Bias, penalties, min_new_tokens mask and processors; returns a new tensor when
    anything applies (the caller's logits may be a buffer the model reuses).
    counts: [B, V] output-token counts of each row (needed when sb.penalties is set).
    When a processor's batched call raises (or returns the wrong shape), its rows are
    retried one by one; a row that still fails is left as it was and its error goes
    into `errors` (the scheduler aborts that request)."""
    if not sb.modifies_logits:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if sb.bias is not None:
        rows, ids, vals = sb.bias
        logits.index_put_((rows, ids), vals, accumulate=True)
    if sb.penalties is not None:
        assert counts is not None
        freq, pres, rep = sb.penalties
        seen = counts > 0
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits -= freq * counts + pres * seen
    if sb.ban is not None:
        logits[sb.ban] = float("-inf")
    for proc, rows, params in sb.processors or ():
        if _apply(proc, logits, rows, params) is not None:
            for i, r in enumerate(rows.tolist()):
                err = _apply(proc, logits, rows[i : i + 1], params[i : i + 1])
                if err is not None and errors is not None:
                    errors[r] = f"custom_logit_processor {type(proc).__name__} failed: {err}"
    return logits


def _apply(
    proc: CustomLogitProcessor, logits: torch.Tensor, rows: torch.Tensor, params: list[dict[str, Any]]
) -> str | None:
    try:
        new = proc(logits[rows], params)
        if not isinstance(new, torch.Tensor) or new.shape != (len(params), logits.shape[1]):
            raise ValueError(f"returned {getattr(new, 'shape', type(new).__name__)}, not [{len(params)}, V]")
        logits[rows] = new.to(logits.dtype)
        return None
    except Exception as e:  # noqa: BLE001 - user code: it fails its own requests, never the scheduler
        return str(e) or type(e).__name__


def fused_takes(sb: SamplingBatch, fused: FusedDraw | None) -> bool:
    """Whether `sample` draws this batch by `fused` (then a bitmask can go with it)."""
    return fused is not None and not sb.need_min_p and not sb.seeded


def sample(logits: torch.Tensor, sb: SamplingBatch, global_gen: torch.Generator | None = None,
           fused: FusedDraw | None = None, bitmask: Bitmask | None = None) -> torch.Tensor:
    """logits: [B, V], already through process_logits -> [B] int64 token ids. The argmax
    runs in the logits' own dtype (upcasting is exact, so it picks the same token);
    sampling in float32: by `fused` (one pass over the logits, the engine's stream)
    when given, unless a row has a seed of its own or min_p; else by the inverse
    cumulative sum at uniforms from `global_gen`. `bitmask`: the ids a grammar allows each row, applied in the
    draw (only where fused_takes(sb) and fused.one_pass; else the caller masks the logits)."""
    if sb.all_greedy and bitmask is None:
        return logits.argmax(dim=-1)
    if fused_takes(sb, fused):
        assert fused is not None
        return fused(logits, sb.temperature, sb.greedy if sb.any_greedy else None, sb.top_k, sb.top_p,
                     sb.need_top_k, sb.need_top_p, bitmask)
    assert bitmask is None, "a bitmask goes with the fused draw only"
    scaled = logits / sb.temperature  # float32 (the temperatures are), in one pass
    probs = torch.softmax(scaled, dim=-1)
    probs = top_k_top_p(probs, sb.top_k, sb.top_p, sb.need_top_k, sb.need_top_p)
    if sb.need_min_p:
        probs = probs.masked_fill(probs < sb.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    # In float64: a GPU scans one row in another order than several, and in float32 its
    # partial sums rise at ids of probability 0 (one was drawn about every 1e5 draws on an
    # H200, a grammar's or min-p's banned id) and differ by an ulp between runs and batch
    # sizes (a seeded draw then depended on its batch); float64's gaps are some 1e-16 wide.
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device, generator=global_gen)
    for i, g in enumerate(sb.generators if sb.seeded else ()):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=g)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    # 1 - u lies in (0, 1], so the target lies in (0, total]: the first entry whose sum
    # reaches it has p > 0 (a zero adds nothing to the sum, so it never reaches first).
    # The clamp keeps a row of NaNs (a processor that banned everything) in range.
    sampled = torch.searchsorted(cdf, (1.0 - u) * cdf[:, -1:]).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    return torch.where(sb.greedy, logits.argmax(dim=-1), sampled) if sb.any_greedy else sampled
