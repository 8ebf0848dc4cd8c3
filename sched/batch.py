"""ScheduleBatch: the host-side description of one forward (prefill chunk or
decode step) and the KV bookkeeping that goes with it.

Allocation is decided by the scheduler before a batch is built: building a
batch writes the new slots into req_to_token and advances each request's
kv_len, never allocates behind the scheduler's back. Everything a forward reads
of the request state is copied here at build time, so the overlap loop may
mutate requests while the batch runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from sgl.cache.req_to_token_pool import ReqToTokenPool
from sgl.sched.req import Req


@dataclass(slots=True)
class ScheduleBatch:
    reqs: list[Req]
    is_decode: bool
    input_ids: list[int] | None  # None for decode: each row's input is its last sampled token, on the device
    rows: list[int]  # req_to_token rows
    positions: torch.Tensor  # [T] int64 (host)
    out_cache_loc: torch.Tensor  # [T] int64
    qo_lens: list[int]
    kv_lens: list[int]
    epochs: list[int]  # each req's epoch at build time
    partial: list[bool]  # prefill chunks that do not reach the end of the request: no token
    # Per req: (first prompt position, count) of the rows before its sampled row whose
    # logits give prompt logprobs (position p scores token p + 1).
    lp_in: list[tuple[int, int]]
    # Beam requests: (group, index in group) of their selection, set when the batch is
    # prepared (sgl.sched.runner.prepare_beams), read when its results are processed.
    beam_index: dict[Req, tuple[int, int]] = field(default_factory=dict)
    # A speculative decode step: each entry's place among its request's rows (0: its last
    # token; j: proposed token j, the entry's input). None for any other batch.
    draft_index: list[int] | None = None

    @property
    def unique_reqs(self) -> list[Req]:
        """Each request once (a beam request has one entry per beam in a decode batch)."""
        return list(dict.fromkeys(self.reqs))

    @property
    def pooled_entries(self) -> list[int]:
        """The entries whose rows this forward pools (in order: their rows of the pooled
        output): an embedding request's every chunk when mean-pooled, its last when
        last-token pooled. Prefills only; empty for decode."""
        if self.is_decode:
            return []
        return [i for i, (r, part) in enumerate(zip(self.reqs, self.partial))
                if r.pooled is not None and (r.pooled.mode == "mean" or not part)]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def extend(cls, reqs: list[Req], out_cache_loc: torch.Tensor, pool: ReqToTokenPool) -> ScheduleBatch:
        """Prefill each req's next `extend_len` tokens on top of its `kv_len` written ones."""
        input_ids: list[int] = []
        positions, qo_lens, kv_lens, partial, lp_in = [], [], [], [], []
        offset = 0
        for r in reqs:
            start, n = r.kv_len, r.extend_len
            if r.needs_input_logprobs:
                a = max(start, r.input_logprob_from)
                lp_in.append((a, max(0, min(start + n, len(r.origin_input_ids) - 1) - a)))
            else:
                lp_in.append((start, 0))
            input_ids.extend(r.all_ids[start : start + n])
            positions.append(torch.arange(start, start + n, dtype=torch.int64))
            pool.write(cast(int, r.req_pool_idx), start, out_cache_loc[offset : offset + n])
            offset += n
            r.kv_len = start + n
            qo_lens.append(n)
            kv_lens.append(r.kv_len)
            partial.append(r.kv_len < r.seq_len)
        rows = cast(list[int], [r.req_pool_idx for r in reqs])  # every admitted request holds a row
        return cls(reqs, False, input_ids, rows, torch.cat(positions), out_cache_loc,
                   qo_lens, kv_lens, [r.epoch for r in reqs], partial, lp_in)

    @property
    def device_inputs(self) -> bool:
        """A speculative step with beam entries: those read their input on the device (-1 here)."""
        return self.input_ids is not None and self.is_decode and any(r.beam is not None for r in self.reqs)

    @classmethod
    def decode(cls, reqs: list[Req], out_cache_loc: torch.Tensor, pool: ReqToTokenPool,
               proposals: list[list[int]] | None = None) -> ScheduleBatch:
        """One step: each req's newest token is written at its own new slot; a beam
        request's rows, one entry each, are consecutive. With `proposals` (a speculative
        step, sgl.sched.speculative) a request's last token and its proposed tokens are
        consecutive entries of its one row at consecutive positions, inputs given here."""
        if proposals is not None:
            return cls._speculative(reqs, out_cache_loc, pool, proposals)
        entries = [r for r in reqs for _ in r.rows]
        rows = [row for r in reqs for row in r.rows]  # every running request holds its rows
        pos = torch.tensor([r.kv_len for r in entries], dtype=torch.int64)
        pool.write_at(torch.tensor(rows), pos, out_cache_loc)
        for r in reqs:
            r.kv_len += 1
        n = len(entries)
        return cls(entries, True, None, rows, pos, out_cache_loc, [1] * n, (pos + 1).tolist(),
                   [r.epoch for r in entries], [False] * n, [(0, 0)] * n)

    @classmethod
    def _speculative(cls, reqs: list[Req], out_cache_loc: torch.Tensor, pool: ReqToTokenPool,
                     proposals: list[list[int]]) -> ScheduleBatch:
        """Every running request's last token is known on the host (a speculative engine's
        requests run serially), but a beam's, whose rows move on the device: -1 there."""
        entries: list[Req] = []
        rows: list[int] = []
        pos: list[int] = []
        ids: list[int] = []
        index: list[int] = []
        for r, prop in zip(reqs, proposals):
            if r.beam is not None:
                for row in r.beam.rows:
                    entries.append(r)
                    rows.append(row)
                    pos.append(r.kv_len)
                    ids.append(-1)
                    index.append(0)
                r.kv_len += 1
                continue
            row = cast(int, r.req_pool_idx)
            last = r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1]
            for j, tok in enumerate([last, *prop]):
                entries.append(r)
                rows.append(row)
                pos.append(r.kv_len + j)
                ids.append(tok)
                index.append(j)
            r.kv_len += 1 + len(prop)
        positions = torch.tensor(pos, dtype=torch.int64)
        pool.write_at(torch.tensor(rows), positions, out_cache_loc)
        n = len(entries)
        return cls(entries, True, ids, rows, positions, out_cache_loc, [1] * n, [p + 1 for p in pos],
                   [r.epoch for r in entries], [False] * n, [(0, 0)] * n, draft_index=index)
