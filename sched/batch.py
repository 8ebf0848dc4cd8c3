"""ScheduleBatch: the host-side description of one forward (prefill chunks, a decode
step, or both: a mixed batch) and the KV bookkeeping that goes with it.

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


@dataclass(frozen=True, slots=True)
class DraftInput:
    """One request's part of a draft model's work in a speculative step: the draft's KV
    from position `start` on, for `tokens` (the request's tokens the draft has not seen,
    ending with its last one when it proposes), then `k` proposed tokens, which fill the k
    entries after the request's first one (`entry`)."""

    entry: int
    start: int
    tokens: list[int]
    k: int


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
    # A decode batch with input_ids given: some entries (-1 there) read theirs on the device.
    device_inputs: bool = False
    # A draft model's speculative step: its work per request. Until the runner's draft fills
    # them when the batch is prepared, the proposal entries' input_ids are -1.
    drafts: list[DraftInput] | None = None
    # A draft's proposals made on the device: (entries, host copy), the copy queued with the
    # step and valid once its results are (take_proposals writes them into input_ids).
    proposed: tuple[list[int], torch.Tensor] | None = None
    # A mixed batch (prefill chunks whose forward also steps running requests): its entries
    # from this one on are decode entries, one token each. None for any other batch.
    decode_from: int | None = None

    def take_proposals(self) -> None:
        """Write a draft's proposals into input_ids, once the step's results are on the host."""
        if self.proposed is not None:
            assert self.input_ids is not None
            entries, tokens = self.proposed
            for e, t in zip(entries, tokens.tolist()):
                self.input_ids[e] = t
            self.proposed = None

    @property
    def decode_start(self) -> int:
        """The first decode entry: 0 for a decode step, len(reqs) for a prefill."""
        if self.is_decode:
            return 0
        return len(self.reqs) if self.decode_from is None else self.decode_from

    def prefills(self, i: int) -> bool:
        """Whether entry i carries prompt tokens (else it is a decode step's)."""
        return i < self.decode_start

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

    @classmethod
    def decode(cls, reqs: list[Req], out_cache_loc: torch.Tensor, pool: ReqToTokenPool,
               proposals: list[list[int]] | None = None, host_inputs: bool = False,
               catch_up: list[tuple[int, list[int]] | None] | None = None) -> ScheduleBatch:
        """One step: each req's newest token is written at its own new slot; a beam
        request's rows, one entry each, are consecutive. Inputs are the last sampled
        tokens on the device, or with `host_inputs` given here where the host knows them
        (sgl.sched.speculative: a request whose device input is stale). With `proposals`
        (a speculative step) a request's last token and its proposed tokens are consecutive
        entries of its one row at consecutive positions; with `catch_up` (a draft model's
        step: each request's (start, tokens) for the draft, or None) the proposals are
        placeholders the draft fills."""
        if proposals is not None:
            return cls._speculative(reqs, out_cache_loc, pool, proposals, catch_up)
        entries = [r for r in reqs for _ in r.rows]
        rows = [row for r in reqs for row in r.rows]  # every running request holds its rows
        pos = torch.tensor([r.kv_len for r in entries], dtype=torch.int64)
        pool.write_at(torch.tensor(rows), pos, out_cache_loc)
        ids = [_host_input(r) for r in entries] if host_inputs else None
        for r in reqs:
            r.kv_len += 1
            r.stale_input = False
        n = len(entries)
        return cls(entries, True, ids, rows, pos, out_cache_loc, [1] * n, (pos + 1).tolist(),
                   [r.epoch for r in entries], [False] * n, [(0, 0)] * n,
                   device_inputs=ids is not None and min(ids, default=0) < 0)

    @classmethod
    def mixed(cls, prefill: ScheduleBatch, step: ScheduleBatch) -> ScheduleBatch:
        """One forward for a prefill batch and a decode step (no beams, no speculation):
        the prefill's entries, then the step's; the step's inputs stay on the device where
        the host does not have them."""
        assert not prefill.is_decode and step.is_decode and step.draft_index is None
        assert prefill.input_ids is not None
        n = len(step.reqs)
        ids = prefill.input_ids + (step.input_ids if step.input_ids is not None else [-1] * n)
        return cls(prefill.reqs + step.reqs, False, ids, prefill.rows + step.rows,
                   torch.cat((prefill.positions, step.positions)),
                   torch.cat((prefill.out_cache_loc, step.out_cache_loc)),
                   prefill.qo_lens + step.qo_lens, prefill.kv_lens + step.kv_lens, prefill.epochs + step.epochs,
                   prefill.partial + step.partial, prefill.lp_in + step.lp_in, device_inputs=min(ids[-n:]) < 0,
                   decode_from=len(prefill.reqs))

    @classmethod
    def _speculative(cls, reqs: list[Req], out_cache_loc: torch.Tensor, pool: ReqToTokenPool,
                     proposals: list[list[int]], catch_up: list[tuple[int, list[int]] | None] | None) -> ScheduleBatch:
        """Each request's last token (known on the host: a speculating request's previous
        step is processed before this one is built) and its proposed tokens; a beam's
        rows, which move on the device, read their inputs there."""
        entries: list[Req] = []
        rows: list[int] = []
        pos: list[int] = []
        ids: list[int] = []
        index: list[int] = []
        drafts: list[DraftInput] | None = [] if catch_up is not None else None
        on_device = False  # entries reading their inputs on the device (beams)
        for i, (r, prop) in enumerate(zip(reqs, proposals)):
            if drafts is not None and (work := cast(list, catch_up)[i]) is not None:
                drafts.append(DraftInput(len(entries), work[0], work[1], len(prop)))
                # The draft writes its inputs' KV, then that of each proposal it feeds back (not the last).
                r.draft_len = work[0] + len(work[1]) + max(len(prop) - 1, 0)
            own = [cast(int, r.req_pool_idx)] * (1 + len(prop)) if r.beam is None else r.beam.rows
            inputs = [_host_input(r), *prop] if r.beam is None else [-1] * len(own)
            on_device = on_device or inputs[0] < 0
            for j, (row, tok) in enumerate(zip(own, inputs)):
                entries.append(r)
                rows.append(row)
                pos.append(r.kv_len + (j if r.beam is None else 0))
                ids.append(tok)
                index.append(j if r.beam is None else 0)
            r.kv_len += 1 + len(prop)
            r.stale_input = bool(prop)  # the device buffer of its row gets one of its rows' samples
        positions = torch.tensor(pos, dtype=torch.int64)
        pool.write_at(torch.tensor(rows), positions, out_cache_loc)
        n = len(entries)
        return cls(entries, True, ids, rows, positions, out_cache_loc, [1] * n, [p + 1 for p in pos],
                   [r.epoch for r in entries], [False] * n, [(0, 0)] * n, draft_index=index,
                   device_inputs=on_device, drafts=drafts)


def _host_input(r: Req) -> int:
    """A decode entry's input where the host has it (its results processed, no beams),
    else -1: the last token its row sampled, on the device."""
    if r.beam is not None or r.inflight:
        return -1
    return r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1]
