"""Multi-LoRA GEMMs: a packed batch whose rows use different adapters (or none) gets each
row's LoRA delta added to a projection's output in one pass over the batch, as S-LoRA and
Punica serve many adapters at once. `LoraBatch` says which adapter slot each row uses;
`lora_apply(x, y, a, b, sub_sizes, batch)` adds, for every row t with slot s >= 0,
(x[t] @ A_s.T) @ B_s.T to y[t], per part of a fused projection (q/k/v, gate/up).

Two paths, picked by `LoraBatch.triton`:

- torch (CPU, and any device without Triton): per slot used, a gather of its rows, two
  small matmuls and an index_add_. Exact in float32; the reference the tests compare with.
- Triton (CUDA): two launches a call, whatever the adapters. A block's rows are gathered
  through `LoraBatch.rows` (the batch's adapter rows grouped by slot). *shrink* writes
  inter[T, n_sub*R] = x[rows] @ A[slot].T into a float32 scratch, one program per
  (block, column block); *expand* adds inter[rows, sub j] @ B[slot, n].T to y, one
  program per (block, column block of the full N), all parts of a fused projection in the
  same launch. Both skip padding blocks (len 0) and base-model blocks (slot -1) at the
  top, so a CUDA graph captured with max_blocks entries replays any batch of that size.

Why hand-written: no library sgl keeps (torch, FlashInfer) has a segmented GEMM that takes
a per-row-block weight index over this layout (A stacked per slot, B with the fused parts'
rows, ranks padded); SGLang's and vLLM's Triton LoRA ops do, but belong to those engines.

What it must not do: decide which adapter sits in which slot, load weights, or fold the
scaling (alpha / r is already in B: the adapter manager's business); synchronise with the
device or allocate by value on the Triton path (it runs under CUDA graph capture).

Invariant both paths rely on: the blocks of one LoraBatch never share a row, so every
element of y is written by at most one program (no atomics) and index_add_ adds once."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sgl.core.host_copy import to_device

BLOCK_M = 16  # rows per block: a block's rows all use one adapter slot (and tl.dot needs 16 rows)
MAX_SUBS = 3  # parts of a fused projection: q, k, v

# Triton block sizes, for an H200 (reasoned, not yet swept: benchmarks/lora_kernels.py times them).
# shrink: the whole n_sub*R in one column block up to 64 (R=16 qkv: 48 -> 64), so x's rows are read
# once per block; K in steps of 128 (16 x 128 of x and 64 x 128 of A, 20 KB bf16 a step, 3 stages).
SHRINK_MAX_N = 64
SHRINK_BLOCK_K = 128
# expand: columns of y per program, the largest power of two up to 128 that divides every part
# (a block in one part loads one inter tile); the b tile (columns x padded rank, widened to float32)
# stays within 16K elements, so rank 256 gets 64 columns. Decode at 256 rows is 256 blocks x
# N / 128 column blocks (8192 programs for qkv): plenty for 132 SMs; y, read and written once, is
# what the kernel costs (memory-bound at R=16).
EXPAND_MAX_N = 128
EXPAND_MAX_TILE = 16384
NUM_WARPS = 4
NUM_STAGES = 3


@dataclass(slots=True)
class LoraBatch:
    """Which adapter slot each packed row of one forward uses: the adapter rows grouped by
    slot (`rows`), cut into blocks of one slot each. Grouping lets a decode batch whose
    requests take turns between adapters run one block per 16 rows of an adapter, not one
    per request."""

    block_start: torch.Tensor  # [NB] int32 on the device: the block's first entry in `rows`
    block_len: torch.Tensor  # [NB] int32: rows in the block, <= BLOCK_M (0: a padding block, skipped)
    block_slot: torch.Tensor  # [NB] int32: the adapter slot of its rows; -1: no adapter (skipped)
    rows: torch.Tensor  # [R] int32: the packed rows of every adapter row, by slot, in row order within one
    groups: list[tuple[int, torch.Tensor]]  # torch path only: (slot, its packed rows int64) per slot used
    triton: bool  # which path lora_apply takes

    @classmethod
    def from_runs(cls, slots: list[int], lens: list[int], device: torch.device, triton: bool) -> LoraBatch:
        """From the requests of a packed batch in order: request i has lens[i] rows and slot
        slots[i] (-1: none). The rows of each slot are gathered (a stable sort: row order kept
        within a slot) and cut into blocks of up to BLOCK_M rows; base-model rows are in no
        block. Built on the host and copied to the device in one copy, without waiting."""
        assert len(slots) == len(lens)
        # numpy on the host: a decode batch of 512 requests builds in tens of microseconds.
        per_row = np.repeat(np.asarray(slots, dtype=np.int64), np.asarray(lens, dtype=np.int64))
        live = np.flatnonzero(per_row >= 0)
        order = live[np.argsort(per_row[live], kind="stable")]
        by_slot = per_row[order]
        n = len(order)
        heads = np.flatnonzero(np.r_[True, by_slot[1:] != by_slot[:-1]]) if n else np.zeros(0, np.int64)
        run_first, run_slot = heads, by_slot[heads]
        run_len = np.diff(np.r_[heads, n]) if n else np.zeros(0, np.int64)
        # Slot i's rows are cut into ceil(len / BLOCK_M) blocks; block j of it starts j * BLOCK_M rows in.
        per_run = -(-run_len // BLOCK_M)
        run_of = np.repeat(np.arange(len(per_run)), per_run)
        at = (np.arange(len(run_of)) - np.repeat(np.cumsum(per_run) - per_run, per_run)) * BLOCK_M
        blocks = np.stack([run_first[run_of] + at, np.minimum(BLOCK_M, run_len[run_of] - at), run_slot[run_of]])
        nb = blocks.shape[1]
        # One int32 tensor, one copy: the three block fields, then the rows, each field at a
        # multiple of 4 entries (16 bytes). Triton specialises a pointer on that alignment: a
        # batch that broke it would compile other kernel variants inside the serving loop.
        at = -(-nb // 4) * 4
        host = np.zeros(3 * at + n, dtype=np.int32)
        for i in range(3):
            host[i * at : i * at + nb] = blocks[i]
        host[3 * at :] = order
        dev = to_device(torch.from_numpy(host), device)
        rows = dev[3 * at :]
        groups: list[tuple[int, torch.Tensor]] = []
        if not triton and n:
            rows64 = rows.long()
            groups = [(int(s), rows64[f : f + k]) for s, f, k in zip(run_slot, run_first, run_len)]
        return cls(dev[:nb], dev[at : at + nb], dev[2 * at : 2 * at + nb], rows, groups, triton)

    @classmethod
    def buffers(cls, num_blocks: int, num_rows: int, device: torch.device) -> LoraBatch:
        """Fixed buffers of num_blocks padding blocks over num_rows rows, for a CUDA graph's
        Triton batch (copy_into fills them before each replay)."""
        blocks = torch.zeros(3, num_blocks, dtype=torch.int32, device=device)
        blocks[2].fill_(-1)
        return cls(blocks[0], blocks[1], blocks[2], torch.zeros(num_rows, dtype=torch.int32, device=device), [], True)

    def view(self, num_blocks: int, num_rows: int) -> LoraBatch:
        """The first entries of fixed buffers (a smaller graph's share of them)."""
        return LoraBatch(self.block_start[:num_blocks], self.block_len[:num_blocks], self.block_slot[:num_blocks],
                         self.rows[:num_rows], [], self.triton)

    @staticmethod
    def max_blocks(num_rows: int, num_requests: int) -> int:
        """The most blocks from_runs can make from num_rows rows in num_requests requests.
        With d slots used (d <= min(requests, rows)) by L_i rows each, the blocks are
        sum ceil(L_i / BLOCK_M) = d + sum floor((L_i - 1) / BLOCK_M) <= d + (rows - d) // BLOCK_M,
        which grows with d."""
        r = min(num_rows, num_requests)
        return r + (num_rows - r) // BLOCK_M

    def copy_into(self, dst: LoraBatch) -> None:
        """CUDA graphs: this batch's blocks and rows into dst's fixed buffers (dst holds
        max_blocks entries and the batch's rows); dst's blocks past this batch's become
        padding (block_len 0)."""
        nb, cap = self.block_len.shape[0], dst.block_len.shape[0]
        nr = self.rows.shape[0]
        assert nb <= cap and nr <= dst.rows.shape[0], f"{nb} blocks, {nr} rows for {cap}, {dst.rows.shape[0]}"
        dst.block_start[:nb].copy_(self.block_start)
        dst.block_len[:nb].copy_(self.block_len)
        dst.block_slot[:nb].copy_(self.block_slot)
        dst.rows[:nr].copy_(self.rows)
        dst.block_len[nb:].zero_()




def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sub_sizes: tuple[int, ...],
               batch: LoraBatch) -> None:
    """y += the LoRA delta, in place, for the rows with an adapter.

    x: [T, K] the layer's input, contiguous; y: [T, N] the base layer's output (same dtype),
    rows with a unit last stride, N = sum(sub_sizes). a: [S, n_sub * R, K] contiguous, rows
    j*R:(j+1)*R sub j's A (rank padded with zero rows to R); b: [S, N, R] contiguous, sub j's
    rows at sum(sub_sizes[:j]) (zero columns past the rank), the scaling folded in. For every
    row t of a block with slot s >= 0 and every sub j:
        y[t, off_j:off_j+N_j] += (x[t] @ a[s, j*R:(j+1)*R].T) @ b[s, off_j:off_j+N_j].T
    Other rows are untouched."""
    t, k = x.shape
    n_sub, r = len(sub_sizes), b.shape[2]
    n = sum(sub_sizes)
    assert 1 <= n_sub <= MAX_SUBS and y.shape == (t, n) and a.shape[1:] == (n_sub * r, k) and b.shape[1] == n
    assert x.is_contiguous() and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    if batch.triton:
        _triton_apply(x, y, a, b, sub_sizes, batch)
        return
    for slot, rows in batch.groups:
        inter = x.index_select(0, rows) @ a[slot].T  # [rows, n_sub * R]
        if n_sub == 1:
            delta = inter @ b[slot].T
        else:
            parts = b[slot].split(sub_sizes)
            delta = torch.cat([inter[:, j * r : (j + 1) * r] @ parts[j].T for j in range(n_sub)], dim=1)
        y.index_add_(0, rows, delta)


def _pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def expand_block_n(sub_sizes: tuple[int, ...], r: int) -> int:
    """Columns per expand program: the largest power of two from 16 to EXPAND_MAX_N (and
    within the tile bound for rank r) that divides every part, so no program straddles two
    parts; when none does (a part not a multiple of 16) the cap, and straddling programs add
    each part they touch separately."""
    cap = min(EXPAND_MAX_N, max(16, EXPAND_MAX_TILE // max(16, _pow2(r))))
    bn = cap
    while bn >= 16:
        if all(s % bn == 0 for s in sub_sizes):
            return bn
        bn //= 2
    return cap


def launch_settings(k: int, sub_sizes: tuple[int, ...], r: int, dtype: torch.dtype
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The compile-time arguments (and warps, stages) of shrink and expand for a layer: K,
    the parts, the padded rank R and the activations' dtype."""
    n_sub, n = len(sub_sizes), sum(sub_sizes)
    nr = n_sub * r
    # float32 inputs: exact products (the interpreter's tests; a float32 model on a GPU); 16-bit
    # ones multiply natively. inter stays float32, and expand widens b to it: tf32 keeps 10 bits
    # of inter where rounding it to bf16 would keep 7.
    prec = "ieee" if dtype == torch.float32 else "tf32"
    shrink = {"K": k, "NR": nr, "BLOCK_M": BLOCK_M, "BLOCK_N": min(SHRINK_MAX_N, max(16, _pow2(nr))),
              "BLOCK_K": min(SHRINK_BLOCK_K, max(16, _pow2(k))), "PREC": prec, "num_warps": NUM_WARPS,
              "num_stages": NUM_STAGES}
    ends = [sum(sub_sizes[: j + 1]) for j in range(n_sub)] + [n] * (MAX_SUBS - n_sub)
    expand = {"N": n, "R": r, "R_PAD": max(16, _pow2(r)), "NSUB": n_sub, "E0": ends[0], "E1": ends[1],
              "BLOCK_M": BLOCK_M, "BLOCK_N": expand_block_n(sub_sizes, r), "PREC": prec, "num_warps": NUM_WARPS,
              "num_stages": 1}
    return shrink, expand


def _triton_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sub_sizes: tuple[int, ...],
                  batch: LoraBatch) -> None:
    t, k = x.shape
    nb = batch.block_len.shape[0]
    if nb == 0 or t == 0:
        return
    cs, ce = launch_settings(k, sub_sizes, b.shape[2], x.dtype)
    inter = torch.empty(t, cs["NR"], dtype=torch.float32, device=x.device)  # rows outside every block: never read
    shrink, expand = kernels()
    shrink[(nb, -(-cs["NR"] // cs["BLOCK_N"]))](
        x, a, inter, batch.block_start, batch.block_len, batch.block_slot, batch.rows, x.stride(0), **cs)
    expand[(nb, -(-ce["N"] // ce["BLOCK_N"]))](
        inter, b, y, batch.block_start, batch.block_len, batch.block_slot, batch.rows, y.stride(0), **ce)


@functools.cache
def kernels() -> tuple[Any, Any]:
    """(shrink, expand), compiled on first launch."""
    import triton
    import triton.language as tl

    @triton.jit
    def shrink(x_ptr, a_ptr, inter_ptr, start_ptr, len_ptr, slot_ptr, rows_ptr, stride_x, K: tl.constexpr,
               NR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PREC: tl.constexpr):
        blk = tl.program_id(0)
        rows_in = tl.load(len_ptr + blk)
        slot = tl.load(slot_ptr + blk)
        if (rows_in == 0) | (slot < 0):  # padding, or base-model rows
            return
        start = tl.load(start_ptr + blk)
        m = tl.arange(0, BLOCK_M)
        rm = m < rows_in
        rows = tl.load(rows_ptr + start + m, mask=rm, other=0).to(tl.int64)  # the block's packed rows
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < NR
        a_rows = a_ptr + slot.to(tl.int64) * (NR * K) + cols[:, None] * K  # a[slot, cols, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            if K % BLOCK_K == 0:  # whole steps: no mask along k (it would cost the loads their vector width)
                xt = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=rm[:, None], other=0.0)
                at = tl.load(a_rows + kk[None, :], mask=cm[:, None], other=0.0)
            else:
                km = (kk < K)[None, :]
                xt = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=rm[:, None] & km, other=0.0)
                at = tl.load(a_rows + kk[None, :], mask=cm[:, None] & km, other=0.0)
            acc += tl.dot(xt, tl.trans(at), input_precision=PREC)
        tl.store(inter_ptr + rows[:, None] * NR + cols[None, :], acc, mask=rm[:, None] & cm[None, :])

    @triton.jit
    def expand(inter_ptr, b_ptr, y_ptr, start_ptr, len_ptr, slot_ptr, rows_ptr, stride_y, N: tl.constexpr,
               R: tl.constexpr, R_PAD: tl.constexpr, NSUB: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        blk = tl.program_id(0)
        rows_in = tl.load(len_ptr + blk)
        slot = tl.load(slot_ptr + blk)
        if (rows_in == 0) | (slot < 0):
            return
        start = tl.load(start_ptr + blk)
        m = tl.arange(0, BLOCK_M)
        rm = m < rows_in
        rows = tl.load(rows_ptr + start + m, mask=rm, other=0).to(tl.int64)  # the block's packed rows
        n0 = tl.program_id(1) * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        cm = cols < N
        r = tl.arange(0, R_PAD)  # ranks below 16 padded for tl.dot: masked to zero
        bt = tl.load(b_ptr + slot.to(tl.int64) * (N * R) + cols[:, None] * R + r[None, :],
                     mask=cm[:, None] & (r < R)[None, :], other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in tl.static_range(NSUB):  # sub j: columns [lo, hi); with BLOCK_N dividing every part, one is live
            lo = E0 * (j >= 1) + (E1 - E0) * (j >= 2)
            hi = E0 + (E1 - E0) * (j >= 1) + (N - E1) * (j >= 2)
            if (n0 < hi) & (n0 + BLOCK_N > lo):
                it = tl.load(inter_ptr + rows[:, None] * (NSUB * R) + j * R + r[None, :],
                             mask=rm[:, None] & (r < R)[None, :], other=0.0)
                bj = tl.where(((cols >= lo) & (cols < hi))[:, None], bt, 0.0)
                acc += tl.dot(it, tl.trans(bj), input_precision=PREC)
        ym = rm[:, None] & cm[None, :]
        yp = y_ptr + rows[:, None] * stride_y + cols[None, :]
        yt = tl.load(yp, mask=ym, other=0.0)
        tl.store(yp, (yt.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=ym)

    return shrink, expand
