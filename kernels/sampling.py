"""Top-k / top-p filtering of a batch of probabilities, the one dispatch point for
it: FlashInfer's renormalisation kernels (no sort) for CUDA tensors when FlashInfer
is installed, a sort in pure torch otherwise (CPU, and the reference the tests
compare with). And `FusedDraw`: one draw per row that reads a [B, V] row once
(unfiltered: sgl's Gumbel-max kernel, greedy rows included; filtered probabilities:
FlashInfer's inverse CDF), where the sampler's own draw (softmax, then a cumulative
sum) makes more passes over it; their Philox stream is one per batch, so rows with a
seed of their own keep the sampler's draw.

Semantics, both paths: order a row by descending probability; a token stays when
its rank is < top_k and the mass strictly before it is < top_p, both measured on
the row as given (top-p is not re-measured on the top-k survivors). The first token
always stays; top_k >= V or top_p >= 1.0 leaves a row whole. The result is
proportional to the kept probabilities and zero elsewhere: the torch path leaves
it unnormalised, FlashInfer's normalises it (the sampler's inverse CDF is blind to
the scale).

Where the two paths differ (tests/test_gpu.py checks the rest):
- Ties at the boundary. FlashInfer keeps every token equal to the k-th largest
  probability (top-k finds that value and keeps >= it), and every token equal to
  the last value of the top-p prefix (it searches for a threshold on values); the
  sort keeps exactly k, and cuts the top-p prefix between equal values in sort
  order. So FlashInfer may keep a few more tokens, all of the boundary value.
- Rounding at the top-p boundary: the masses are float32 sums taken in different
  orders, so a token whose preceding mass equals top_p to within rounding may fall
  on either side.
- FlashInfer's top-k kernel splits a long row over several CTAs that add their
  partial sums atomically, so the normalising constant (only the scale) may differ
  in the last bit from run to run; which tokens stay does not (a seeded draw could
  change only where its uniform falls within that rounding of a boundary between two
  tokens' cumulative sums)."""

from __future__ import annotations

import torch

from sgl.kernels import triton_installed
from sgl.kernels.gumbel_draw import Bitmask, gumbel_draw
from sgl.kernels.layers import flashinfer_module


class FusedDraw:
    """The sampler's draw on a GPU, on one engine's own Philox stream: unfiltered rows
    (temperature only) by sgl's one-pass Gumbel-max kernel (kernels/gumbel_draw.py),
    filtered rows by FlashInfer's top-k/top-p renormalisation and its inverse-CDF draw.
    The seed and the offset live in device tensors, the offset advanced in place after
    each draw, so a draw never reads the host, and FlashInfer's cache of (seed, offset)
    arguments keeps one entry per batch size instead of a new one per call. Only where
    `available` (CUDA, FlashInfer and Triton)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.fi = flashinfer_module()
        assert self.fi is not None and device.type == "cuda"
        self.seed = torch.tensor([seed % (1 << 63)], dtype=torch.int64, device=device)
        self.offset = torch.zeros(1, dtype=torch.int64, device=device)

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cuda" and flashinfer_module() is not None and triton_installed()

    @classmethod
    def ready(cls, device: torch.device, seed: int, vocab: int, dtype: torch.dtype,
              masks: bool = False) -> FusedDraw | None:
        """One warmed up for `vocab`-wide `dtype` logits where `available`, else None;
        `masks`: the variants that apply a grammar's bitmask too."""
        if not cls.available(device):
            return None
        draw = cls(device, seed)
        draw.warm_up(vocab, dtype, masks)
        return draw

    def warm_up(self, vocab: int, dtype: torch.dtype, masks: bool = False) -> None:
        """Compile the one-pass draw's kernels now, not at the first request that needs
        one (each compile holds the scheduler's loop ~0.5 s on an H200, which a W2-like
        grammar run otherwise pays inside its timed run): sampled rows, and sampled beside greedy; with
        `masks`, each of those with a bitmask on every row and on some rows; and without masks
        for float32 logits too, which penalties, logit biases, min_new_tokens' bans and logit
        processors leave. The stream starts over after."""
        dev = self.seed.device
        temperature = torch.ones(2, 1, device=dev)
        greedy = torch.tensor([True, False], device=dev)
        bitmasks: list[Bitmask | None] = [None]
        if masks:
            words = torch.full((2, (vocab + 31) // 32), -1, dtype=torch.int32, device=dev)
            bitmasks += [Bitmask(words, None, vocab),
                         Bitmask(words, torch.tensor([0, -1], dtype=torch.int32, device=dev), vocab)]
        for logits_dtype in dict.fromkeys((dtype, torch.float32)):
            logits = torch.zeros(2, vocab, dtype=logits_dtype, device=dev)
            for bitmask in bitmasks if logits_dtype == dtype else [None]:
                for g in (None, greedy):
                    gumbel_draw(logits, temperature, g, self.seed, self.offset, bitmask)
        self.offset.zero_()

    @staticmethod
    def one_pass(need_top_k: bool, need_top_p: bool) -> bool:
        """Whether a batch with these filters draws in one pass (and can take a bitmask)."""
        return not (need_top_k or need_top_p)

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor | None,
                 top_k: torch.Tensor, top_p: torch.Tensor, need_top_k: bool, need_top_p: bool,
                 bitmask: Bitmask | None = None) -> torch.Tensor:
        """logits: [B, V] raw (any float dtype); temperature: [B, 1] float32 (1.0 on greedy
        rows); greedy: [B] bool, or None when no row is greedy; bitmask: the ids rows may
        take (only where `one_pass`). One token id per row ([B] int64): greedy rows the
        argmax, the others drawn from softmax(logits / T) filtered as top_k_top_p keeps it."""
        if self.one_pass(need_top_k, need_top_p):
            return gumbel_draw(logits, temperature, greedy, self.seed, self.offset, bitmask)
        assert bitmask is None, "a bitmask goes with the one-pass draw only"
        probs = top_k_top_p(torch.softmax(logits / temperature, dim=-1), top_k, top_p, need_top_k, need_top_p)
        ids = self.fi.sampling.sampling_from_probs(probs, seed=self.seed, offset=self.offset).long()
        self.offset.add_((logits.shape[0] + 3) // 4 * 4)  # one uniform per row (inverse CDF), as FlashInfer counts
        return ids if greedy is None else torch.where(greedy, logits.argmax(dim=-1), ids)


def top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                need_top_k: bool = True, need_top_p: bool = True) -> torch.Tensor:
    """probs: [B, V] float32, rows summing to 1; top_k: [B] int64 (V where disabled);
    top_p: [B] float32 (1.0 where disabled). need_*: whether any row uses the filter
    (False skips it). Returns a new [B, V] tensor (or probs itself when neither)."""
    if not (need_top_k or need_top_p):
        return probs
    if probs.is_cuda and (fi := flashinfer_module()) is not None:
        # Top-p first, on the full distribution. Both filters keep a prefix of the sorted
        # row, so top-k of the top-p survivors is the shorter prefix: the same intersection
        # as below. (Top-k first would measure top-p on the renormalised survivors.)
        if need_top_p:
            probs = fi.sampling.top_p_renorm_probs(probs, top_p.float())  # p >= 1.0: row kept whole
        if need_top_k:
            probs = fi.sampling.top_k_renorm_probs(probs, top_k.int())  # k >= V: row kept whole
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_p, dtype=torch.bool)
    if need_top_k:
        drop |= torch.arange(sorted_p.shape[-1], device=probs.device)[None, :] >= top_k[:, None]
    if need_top_p:
        # Drop a token once the mass strictly before it reaches top_p (the first always stays).
        # top_p = 1.0 keeps the row whole even where the float cumsum reaches 1 before its tail.
        p = top_p[:, None]
        drop |= ((sorted_p.cumsum(dim=-1) - sorted_p) >= p) & (p < 1.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
