"""The sampler: next-token ids from a batch of logits, vectorised over the batch.

Greedy rows take the argmax. Sampled rows apply temperature, top-k, top-p and
min-p as batched tensor ops, then draw by the exponential race
(argmax p / E, E ~ Exp(1)), which samples exactly from p. A request with a seed
draws its noise from its own generator, so its tokens do not depend on what
else is in the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl.sched.req import Req


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters as tensors, built once per batch."""

    all_greedy: bool
    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B, 1] float32 (1.0 on greedy rows)
    top_k: torch.Tensor  # [B] int64, vocab size where disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    generators: list[torch.Generator | None]

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device) -> SamplingBatch:
        ps = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in ps]
        top_k = [vocab_size if (p.top_k < 1 or p.top_k > vocab_size) else p.top_k for p in ps]
        all_greedy = all(greedy)

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            t = torch.tensor(values, dtype=dtype)
            # Pinned and asynchronous: building a batch must not wait for the running one.
            return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)

        if all_greedy:  # the fast path reads none of the tensors
            empty = torch.empty(0, device=device)
            return cls(True, empty, empty, empty, empty, empty, False, False, False, [])
        return cls(
            all_greedy=False,
            greedy=dev(greedy, torch.bool),
            temperature=dev([1.0 if g else p.temperature for p, g in zip(ps, greedy)], torch.float32)[:, None],
            top_k=dev(top_k, torch.int64),
            top_p=dev([p.top_p for p in ps], torch.float32),
            min_p=dev([p.min_p for p in ps], torch.float32),
            need_top_k=any(k < vocab_size for k in top_k),
            need_top_p=any(p.top_p < 1.0 for p in ps),
            need_min_p=any(p.min_p > 0.0 for p in ps),
            generators=[r.generator for r in reqs],
        )


def sample(logits: torch.Tensor, sb: SamplingBatch, global_gen: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] float32 -> [B] int64 token ids."""
    greedy_ids = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy_ids
    probs = torch.softmax(logits / sb.temperature, dim=-1)
    if sb.need_top_k or sb.need_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_p, dtype=torch.bool)
        if sb.need_top_k:
            ranks = torch.arange(sorted_p.shape[-1], device=probs.device)
            drop |= ranks[None, :] >= sb.top_k[:, None]
        if sb.need_top_p:
            # Drop a token once the mass strictly before it already reaches top_p (the first always stays).
            drop |= (sorted_p.cumsum(dim=-1) - sorted_p) >= sb.top_p[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if sb.need_min_p:
        probs = probs.masked_fill(probs < sb.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    noise = torch.empty_like(probs)
    noise.exponential_(generator=global_gen)
    for i, g in enumerate(sb.generators):
        if g is not None:
            row = torch.empty(probs.shape[-1], dtype=probs.dtype, device=probs.device)
            noise[i] = row.exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(sb.greedy, greedy_ids, sampled)
