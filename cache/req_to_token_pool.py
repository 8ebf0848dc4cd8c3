"""The request-to-token table: one row per running request, holding the KV slot
index of each of its tokens. It owns rows, never KV slots.

The table lives on the host, where the scheduler and the radix cache read and
write it without ever waiting for the device. A mirror of it lives on the model's
device, where the forward builds its KV indices: every write goes through `write`
or `write_at`, which remember the changed range of each row, and `sync` copies
those ranges (read from the host table at sync time, so the last write wins) to
the mirror, queued on the current stream before the batch that reads them. A
decode step thus ships one slot per request, not every request's whole context;
when its `write_at` was the only write since the last sync, its cells go as they
are, in one copy, with nothing to gather."""

from __future__ import annotations

import torch

from sgl.core.host_copy import to_device


class ReqToTokenPool:
    """A [size, max_context] int32 table; `alloc` hands out free rows."""

    def __init__(self, size: int, max_context: int, mirror_device: str | torch.device = "cpu") -> None:
        if size < 1 or max_context < 1:
            raise ValueError(f"ReqToTokenPool needs size >= 1 and max_context >= 1, got {size}, {max_context}")
        self.size = size
        self.max_context = max_context
        self.req_to_token = torch.zeros((size, max_context), dtype=torch.int32)
        self.mirror = torch.zeros((size, max_context), dtype=torch.int32, device=mirror_device)
        # Per row, the range [lo, hi) written since the last sync; hi == 0: clean.
        self._lo = torch.full((size,), max_context, dtype=torch.int64)
        self._hi = torch.zeros(size, dtype=torch.int64)
        self._clean = True  # nothing written since the last sync
        self._lone: torch.Tensor | None = None  # [3, n] (row, position, slot): a write_at, the only write since
        self.clear()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"row {row} out of range [0, {self.size})")
        if self._is_free[row]:
            raise RuntimeError(f"request row double free: row {row} is already free")
        self._is_free[row] = True
        self._free.append(row)

    def clear(self) -> None:
        """Every row free."""
        self._free = list(range(self.size - 1, -1, -1))  # pop() hands out row 0 first
        self._is_free = [True] * self.size  # a row freed twice is an error at once, never a row with two owners

    # ---- writes and the device mirror ----

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """row[start:start + len(slots)] = slots."""
        end = start + slots.numel()
        self.req_to_token[row, start:end] = slots
        self._lo[row] = min(int(self._lo[row]), start)
        self._hi[row] = max(int(self._hi[row]), end)
        self._clean, self._lone = False, None

    def write_at(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """row[rows[i], positions[i]] = slots[i] (one decode step: a row appears once, or
        at several positions in a speculative one)."""
        self.req_to_token[rows, positions] = slots.to(torch.int32)
        self._lo.scatter_reduce_(0, rows, positions, reduce="amin")
        self._hi.scatter_reduce_(0, rows, positions + 1, reduce="amax")
        # Its (row, position) pairs are distinct: no cell of the table is written twice by one call.
        self._lone = torch.stack((rows, positions, slots.to(torch.int64))) if self._clean else None
        self._clean = False

    def sync(self) -> None:
        """Queue the copy of every range written since the last sync to the mirror."""
        if self._clean:
            return
        lone, self._lone, self._clean = self._lone, None, True
        dev = self.mirror.device
        if lone is not None:  # one write_at alone (a decode or speculative step): its cells as they are
            self._hi[lone[0]] = 0
            self._lo[lone[0]] = self.max_context
            r, pos, values = to_device(lone, dev)  # one copy, not three
            self.mirror[r, pos] = values.to(torch.int32)
            return
        rows = (self._hi > 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        lo = self._lo[rows]
        n = self._hi[rows] - lo
        self._hi[rows] = 0
        self._lo[rows] = self.max_context
        total = int(n.sum())
        values = gather_kv_indices(self.req_to_token, rows, lo, n, total)
        r, lo, n, values = (to_device(t, dev) for t in (rows, lo, n, values))
        row_of, pos = flat_positions(r, lo, n, total)
        self.mirror[row_of, pos] = values


def flat_positions(
    rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every cell of the ranges row rows[i], columns [starts[i],
    starts[i] + lens[i]), concatenated over i; on the inputs' device, without a host
    sync (the caller knows the total)."""
    row_of = torch.repeat_interleave(rows, lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens  # each range's offset in the output
    pos = torch.arange(total, device=rows.device) - torch.repeat_interleave(first - starts, lens, output_size=total)
    return row_of, pos


def gather_kv_indices(
    table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, total: int
) -> torch.Tensor:
    """Concatenate table[rows[i], starts[i]:starts[i] + lens[i]] over i (int32), on the
    table's device, without a host sync."""
    row_of, pos = flat_positions(rows, starts, lens, total)
    return table[row_of, pos]
