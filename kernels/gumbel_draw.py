"""One token per row drawn from softmax(logits / T) in a single read of the logits, in
Triton: the Gumbel-max draw (argmax of logits / T + G, G = -log(-log U), U uniform), which
samples exactly from that softmax, with greedy rows (argmax of the logits as they are)
in the same pass.

Why a kernel of our own: the sampler's unfiltered draw on a GPU (temperature, no top-k,
top-p or min-p: W2's case) was a float32 copy of the [B, V] logits divided by the
temperature (92 us a step at 256 rows and Qwen3's 151,936 ids, benchmarks/RESULTS.md,
2026-12-02) and then FlashInfer's `sampling_from_logits`, which reads that copy again
(float32 only). Here the bf16 logits are read once and nothing of [B, V] is written.

Work split: one program per (row, chunk of 4 x LANES x TILES ids); each lane keeps its own best
score and id (strictly greater replaces, so within a lane the first of equal scores
stays), reduced once at the end to the lowest id among the chunk's maxima; a second
kernel takes each row's best chunk the same way, so greedy rows get torch.argmax's
answer exactly (the first index of the maximum). The noise is Triton's Philox: counter =
offset / 4 + row * per_row + (column // 4 of the block) + lane, four uniforms per counter,
key = seed. seed and offset live in device tensors (the caller's stream), and the second
kernel advances the offset by the uniforms this draw used, so a draw never reads the host
and the next draw's noise is fresh. The offset counts uniforms, as FlashInfer's samplers
count it on the same tensor (kernels/sampling.FusedDraw): its row 0 draws from counter
offset / 4 with the same Philox, past every counter an earlier draw here used.

A grammar's bitmask (xgrammar's layout) can be applied in the same read: a disallowed id
scores -inf, so the [B, V] float32 copy that masking in place needs is not made.

It draws only: temperature-free filters (top-k, top-p, min-p) and per-request seeds are
the sampler's (sched/runner/sampler.py) other paths."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

LANES = 256  # lanes of a tile: one Philox counter each, four uniforms for four consecutive ids
TILES = 8  # tiles of 4 x LANES ids per program
MAX_CHUNKS = 128  # programs per row: rows of up to 1,048,576 ids at the defaults


@dataclass(frozen=True, slots=True)
class Bitmask:
    """The ids rows may take, as xgrammar fills them: words [G, ceil(width / 32)] int32
    (bit c % 32 of word c // 32 allows id c; ids from `width` on are never allowed) on
    the logits' device; rows: [B] int32, each logits row's mask row or -1 for none (None:
    logits row i takes mask row i, every row masked)."""

    words: torch.Tensor
    rows: torch.Tensor | None
    width: int


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    # The bitmask's width and words: not specialised on (a value's divisibility by 16), so the
    # warm-up's masked variants (sgl.kernels.sampling.FusedDraw.warm_up) serve every tokenizer.
    @triton.jit(do_not_specialize=["words", "width"])
    def chunk_best(logits_ptr, stride_b, n, temp_ptr, greedy_ptr, seed_ptr, offset_ptr, val_ptr, idx_ptr, per_row,
                   nc, mask_ptr, mask_row_ptr, words, width, HAS_GREEDY: tl.constexpr, MASK: tl.constexpr,
                   MASK_ROWS: tl.constexpr, Q: tl.constexpr, CHUNK: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        lane = tl.arange(0, Q)
        # A tile of 4Q consecutive ids as [Q, 4]: lane l holds ids 4l..4l+3 of the tile, the
        # four uniforms of its one Philox counter.
        tile = lane[:, None] * 4 + tl.arange(0, 4)[None, :]
        row = logits_ptr + b.to(tl.int64) * stride_b
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, n)
        best = tl.full([Q, 4], float("-inf"), tl.float32)
        best_i = lo + tile  # a row of -inf only (never a sampler's input) still names an id < n
        # A bitmask row (an xgrammar mask: bit c % 32 of word c // 32 allows id c; ids from
        # `width` on never), or none: masked ids score -inf, as if the logit were.
        masked = b < 0  # False
        limit = n
        bits = mask_ptr
        if MASK:
            mr = b
            if MASK_ROWS:
                mr = tl.load(mask_row_ptr + b)
            masked = mr >= 0
            limit = tl.where(masked, tl.minimum(n, width), n)
            bits = mask_ptr + tl.where(masked, mr, 0).to(tl.int64) * words
        noisy = True
        if HAS_GREEDY:
            noisy = tl.load(greedy_ptr + b) == 0
        inv_t = 1.0 / tl.load(temp_ptr + b)
        seed = tl.load(seed_ptr)
        ctr0 = tl.load(offset_ptr) // 4 + b.to(tl.int64) * per_row
        for off in range(lo, hi, 4 * Q):
            cols = off + tile
            x = tl.load(row + cols, mask=cols < limit, other=float("-inf")).to(tl.float32)
            if MASK:
                if masked:
                    w = tl.load(bits + cols // 32, mask=cols < limit, other=0)
                    x = tl.where(((w >> (cols % 32)) & 1) != 0, x, float("-inf"))
            if noisy:  # one branch a row: every iteration of a program takes the same side
                u0, u1, u2, u3 = tl.rand4x(seed, ctr0 + off // 4 + lane)
                u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [Q, 4])
                x = x * inv_t - tl.log(-tl.log(u))
            better = x > best  # strictly: a lane keeps the first of equal scores
            best = tl.where(better, x, best)
            best_i = tl.where(better, cols, best_i)
        m = tl.max(tl.max(best, 1), 0)
        tl.store(val_ptr + b * nc + c, m)
        tl.store(idx_ptr + b * nc + c, tl.min(tl.min(tl.where(best == m, best_i, 2147483647), 1), 0))

    @triton.jit
    def row_best(val_ptr, idx_ptr, out_ptr, offset_ptr, used, nc, NC: tl.constexpr):
        b = tl.program_id(0)
        c = tl.arange(0, NC)
        v = tl.load(val_ptr + b * nc + c, mask=c < nc, other=float("-inf"))
        i = tl.load(idx_ptr + b * nc + c, mask=c < nc, other=2147483647)
        m = tl.max(v, 0)
        # The lowest id among the best chunks (chunks hold increasing ids; a row of -inf: chunk 0's).
        pick = tl.min(tl.where(v == m, i, 2147483647), 0)
        tl.store(out_ptr + b, pick.to(tl.int64))
        if b == 0:  # every chunk_best program has read the offset: this kernel runs after them
            tl.store(offset_ptr, tl.load(offset_ptr) + used)

    return chunk_best, row_best


def gumbel_draw(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor | None, seed: torch.Tensor,
                offset: torch.Tensor, bitmask: Bitmask | None = None, lanes: int = LANES,
                tiles: int = TILES) -> torch.Tensor:
    """logits: [B, V] (any float dtype, rows of stride-1 ids); temperature: [B] or [B, 1]
    float32 (> 0 on sampled rows); greedy: [B] bool (those rows take the argmax), or None
    when no row is greedy; seed, offset: [1] int64 on logits' device (offset advanced in
    place); bitmask: the ids each row may take (None: all). Returns [B] int64 ids.
    `lanes` (a power of two) and `tiles` set the work split (tests shrink it for Triton's
    interpreter); the ids drawn depend on them."""
    b, v = logits.shape
    chunk = 4 * lanes * tiles
    assert logits.stride(1) == 1 and v < 2**31
    nc = -(-v // chunk)
    assert nc <= MAX_CHUNKS, f"a vocabulary of {v} ids is more than this kernel's {MAX_CHUNKS * chunk}"
    per_row = nc * chunk // 4  # Philox counters a row uses
    chunk_best, row_best = _kernels()
    vals = torch.empty(b, nc, dtype=torch.float32, device=logits.device)
    idx = torch.empty(b, nc, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    temp = temperature.reshape(b)
    words = rows = temp  # not read without a bitmask (a pointer argument all the same)
    n_words = width = 0
    if bitmask is not None:
        words, n_words, width = bitmask.words, bitmask.words.shape[1], bitmask.width
        rows = temp if bitmask.rows is None else bitmask.rows
    chunk_best[(b, nc)](logits, logits.stride(0), v, temp, temp if greedy is None else greedy, seed, offset, vals, idx,
                        per_row, nc, words, rows, n_words, width, HAS_GREEDY=greedy is not None,
                        MASK=bitmask is not None, MASK_ROWS=bitmask is not None and bitmask.rows is not None,
                        Q=lanes, CHUNK=chunk, num_warps=4)
    nc_pad = max(16, 1 << (nc - 1).bit_length())
    row_best[(b,)](vals, idx, out, offset, 4 * b * per_row, nc, NC=nc_pad, num_warps=1)
    return out
