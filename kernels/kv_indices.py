"""A batch's KV slots gathered from the request table in one launch: row i's
n = indptr[i + 1] - indptr[i] slots from column `start` on, table[rows[i], start:start + n],
written at out[indptr[i]:indptr[i + 1]]. In Triton, for CUDA tensors. Start 0 gives a
forward's slots; a cascade's shared prefix length gives each row's own slots past it.

Why: the same in torch ops (sgl.cache.req_to_token_pool.gather_kv_indices: two
repeat_interleaves, a cumsum, an arange, three subtractions and an index) is eight
launches from Python, and every forward's attention metadata needs it on the host's
critical path while the host is the slower side (small decode batches): on an H100 it took
a tenth of the scheduler thread's time at one request (benchmarks/RESULTS.md, 2026-12-05). The
offsets are the indptr the attention metadata uploads anyway.

It reads the table only: which slots a request owns is the KV cache's business."""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 512  # slots a program copies per iteration


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # One compile for every start and every slice of rows or offsets (a mixed batch's decode
    # rows begin anywhere): compiled when the engine starts, never inside a request's step.
    @triton.jit(do_not_specialize=["start", "rows_ptr", "indptr_ptr"])
    def gather_rows(table_ptr, stride, start, rows_ptr, indptr_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        src = table_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride + start
        lo = tl.load(indptr_ptr + i)
        n = tl.load(indptr_ptr + i + 1) - lo
        dst = out_ptr + lo
        for j in range(0, n, BLOCK):
            offs = j + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    return gather_rows


def gather_rows(table: torch.Tensor, rows: torch.Tensor, indptr: torch.Tensor, total: int,
                start: int = 0) -> torch.Tensor:
    """table: [R, C] with a unit last stride; rows: [B] row numbers; indptr: [B + 1] int32
    offsets starting at 0, total = indptr[-1] (known to the caller: no host sync); each row
    read from column `start`. Returns the [total] slots, in table's dtype, on its device."""
    out = torch.empty(total, dtype=table.dtype, device=table.device)
    if rows.numel() and total:
        _kernel()[(rows.numel(),)](table, table.stride(0), start, rows, indptr, out, BLOCK=BLOCK)
    return out
