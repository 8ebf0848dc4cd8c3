"""KVCache: the one owner of KV ownership in the scheduler: the free slots (the
allocator), the request rows (the req_to_token table), the radix tree and the beams'
shared tails, changed together and only through these methods.

A slot has exactly one owner at any time: the free list, a tree node, or one live
request's uncached tail, req_to_token[row, len(prefix_indices):kv_len] (a beam
request's tails are sgl.cache.beam_tails'). A request's tree prefix is locked through
`last_node` while it holds a row. When the scheduler is idle the accounting is checked
(`check_idle`); with SGL_STRICT_INVARIANTS=1 a broken one raises.

It never decides which requests run or end: the scheduler's owners ask it for slots
and rows, and hand them back."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch

from sgl.cache.beam_tails import BeamTails
from sgl.cache.kv_allocator import TokenToKVPoolAllocator
from sgl.cache.radix_cache import MatchResult, RadixCache
from sgl.cache.req_to_token_pool import ReqToTokenPool
from sgl.core.log import get_logger
from sgl.sched.req import Req


class KVCache:
    def __init__(self, pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, disable_radix_cache: bool) -> None:
        self.pool = pool
        self.allocator = allocator
        self.tree = RadixCache(pool, allocator, disable=disable_radix_cache)
        self.beam_tails = BeamTails(allocator)
        self.log = get_logger("scheduler")
        self.strict = os.environ.get("SGL_STRICT_INVARIANTS") == "1"
        self.violations = 0  # idle checks that found the accounting broken
        self._checked = False  # nothing changed since the last idle check

    # ---- room and slots ----------------------------------------------------------

    def available(self) -> int:
        """KV slots free or evictable now."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def freed_by(self, reqs: list[Req]) -> int:
        """KV slots that retracting `reqs` (no beams; KV given back uncached) would make
        free or evictable: their tails, and the tree nodes locked by them alone."""
        tails = sum(r.kv_len - len(r.prefix_indices) for r in reqs if r.req_pool_idx is not None)
        through: Counter[int] = Counter()
        nodes: dict[int, Any] = {}
        for r in reqs:
            node = r.last_node if r.req_pool_idx is not None else None
            while node is not None and node is not self.tree.root:
                through[node.id] += 1
                nodes[node.id] = node
                node = node.parent
        return tails + sum(len(node.value) for i, node in nodes.items() if through[i] == node.lock_ref)

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` KV slots, evicting from the radix tree what the free ones lack; None if even that fails."""
        self._checked = False
        short = n - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc(n)

    # ---- a request's rows ----------------------------------------------------------

    def take_rows(self, req: Req, match: MatchResult) -> None:
        """Give an admitted request its row (a row per beam) holding its cached prefix,
        whose lock the caller took. The caller checked that the rows are free."""
        self._checked = False
        row = self.pool.alloc()
        assert row is not None
        req.req_pool_idx = row
        if req.beam is not None:  # the other beams' rows, filled from this one at the first selection
            req.beam.rows = [row]
            for _ in range(req.beam.width - 1):
                extra = self.pool.alloc()
                assert extra is not None
                req.beam.rows.append(extra)
        prefix = match.indices
        req.prefix_indices = prefix
        req.last_node = match.last_node
        if len(prefix):
            self.pool.write(row, 0, prefix)
        req.kv_len = len(prefix)

    def cache_unfinished(self, req: Req) -> None:
        """Hand the request's written tokens to the tree (they become shareable; it keeps its lock)."""
        self.tree.cache_unfinished_req(req)

    def truncate(self, req: Req, kv_len: int) -> None:
        """Free the request's own slots from position `kv_len` on (a speculative step's
        rows past the tokens it took)."""
        if kv_len < req.kv_len:
            self._checked = False
            self._free_own(req, kv_len)
            req.kv_len = kv_len
            req.draft_len = min(req.draft_len, kv_len)

    def _free_own(self, req: Req, start: int) -> None:
        """Free the request's own slots at positions [start, kv_len) of its row."""
        self.allocator.free(self.pool.req_to_token[req.req_pool_idx, start : req.kv_len].to(torch.int64))

    def release(self, req: Req, cache: bool) -> None:
        """Give back the request's rows and KV: into the radix tree, or freed outright
        (a beam request's beams first: its own row then holds the prompt alone)."""
        if req.req_pool_idx is None:
            return
        self._checked = False
        if req.beam is not None:
            self._release_beams(req)
        if cache:
            self.tree.cache_finished_req(req)
        else:
            self._free_own(req, len(req.prefix_indices))
            self.tree.dec_lock_ref(req.last_node)
            self.pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.prefix_indices = req.prefix_indices[:0]
        req.last_node = None
        req.kv_len = 0
        req.draft_len = 0

    def _release_beams(self, req: Req) -> None:
        """What a beam request holds beyond its own row: every slot on a beam (alive ones
        and those of steps in flight) and the other rows."""
        b = req.beam
        assert b is not None
        prompt = len(req.origin_input_ids)
        if req.kv_len > prompt and len(b.rows) == b.width:
            tails = self.pool.req_to_token[torch.tensor(b.rows), prompt : req.kv_len].reshape(-1).to(torch.int64)
            self.allocator.free(tails.unique())
        for row in b.rows[1:]:
            self.pool.free(row)
        del b.rows[1:]
        req.kv_len = min(req.kv_len, prompt)

    def fan_out_prompt(self, req: Req) -> None:
        """A beam request's first selection: its prompt becomes shareable and every beam's
        row takes the prompt row's entries (synced to the device with the next step)."""
        assert req.beam is not None
        self.cache_unfinished(req)
        rows, prompt = req.beam.rows, len(req.origin_input_ids)
        for row in rows[1:]:
            self.pool.write(row, 0, self.pool.req_to_token[rows[0], :prompt])

    def move_beam_rows(self, req: Req, parents: list[int], length: int, written: torch.Tensor) -> None:
        """A beam step's selection on the host table, as the device made it: each beam row
        takes its parent's first `length` entries; the step's `written` slots and those no
        beam continues from change hands (sgl.cache.beam_tails)."""
        assert req.beam is not None
        b, table = req.beam, self.pool.req_to_token
        rows = torch.tensor(b.rows, dtype=torch.int64)
        before = (table[rows, length - 2].to(torch.int64) if length - 2 >= len(req.origin_input_ids)
                  else torch.zeros(b.width, dtype=torch.int64))
        sources = torch.tensor(parents, dtype=torch.int64)
        table[rows, :length] = table[rows[sources], :length]
        self.beam_tails.step(written, before, torch.bincount(sources, minlength=b.width))

    # ---- failures and flushes ------------------------------------------------------

    def reads_unwritten(self, slots: torch.Tensor, holders: list[Req]) -> list[Req] | None:
        """Slots a failed batch was to write hold no valid KV, and the tree may already
        share some (a leader's prompt, a chunk cached while the next was being built).
        None when the tree holds none of them; else the holders whose prefix reaches them
        (to be retracted, then `drop_unlocked`)."""
        slots = slots.reshape(-1).to("cpu", torch.int64)
        if self.tree.disable or not slots.numel() or not bool(torch.isin(self.tree.slots(), slots).any()):
            return None
        return [r for r in holders
                if r.prefix_indices.numel() and bool(torch.isin(r.prefix_indices.cpu(), slots).any())]

    def drop_unlocked(self) -> None:
        """Evict the tree's whole unlocked part (after a failed batch's KV got into it)."""
        self.tree.evict(self.tree.evictable_size())
        self.log.warning("dropped the radix cache's unlocked part: a failed batch's KV was in it")

    def forget(self, namespace: int) -> None:
        """Free what the tree holds under a namespace (an unloaded LoRA adapter's: no
        request of it may hold KV)."""
        self._checked = False
        self.tree.drop_namespace(namespace)

    def flush(self) -> None:
        """Empty the radix tree (no request may hold KV)."""
        self._checked = False
        self.tree.reset()

    # ---- accounting ----------------------------------------------------------------

    def check_idle(self) -> None:
        """With no request live, every slot must be free or the tree's, and every row free.
        Checked once per idle spell; a failure is counted and logged, and raised when strict."""
        if self._checked:
            return
        self._checked = True
        try:
            self.tree.check_invariants(None)
            if self.pool.available_size() != self.pool.size:
                raise AssertionError(f"{self.pool.size - self.pool.available_size()} request rows held while idle")
        except AssertionError as e:
            self.violations += 1
            self.log.error("KV accounting is broken", error=str(e))
            if self.strict:
                raise

    def info(self) -> dict[str, Any]:
        return {"kv_free": self.allocator.available_size(), "kv_evictable": self.tree.evictable_size(),
                "kv_protected": self.tree.protected_size(), "invariant_violations": self.violations}
