"""Stateful property test of the radix cache with the allocator and the req pool, driven
the way the scheduler drives them, against a plain model: the set of cached prefixes
with their last-use stamps, and what each KV slot was computed for. Every prefix and
every slot's content is keyed by its namespace too, so a match that crossed
namespaces (served one adapter's KV to another) would fail the model."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from sgl.cache.kv_allocator import TokenToKVPoolAllocator
from sgl.cache.radix_cache import RadixCache, TreeNode
from sgl.cache.req_to_token_pool import ReqToTokenPool

try:
    from .hypothesis_profiles import PROFILE, PROFILE_NAME
except ImportError:
    from hypothesis_profiles import PROFILE, PROFILE_NAME  # type: ignore[no-redef]

SIZE = 64  # small, so eviction and running out of slots both happen
ROWS = 4
MAX_CONTEXT = 40
# Common starts make requests share prefixes; the short alphabet makes suffixes collide.
PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5,) * 10, (2, 3)]
prompts = st.builds(
    lambda pre, suf: list(pre) + suf or [1], st.sampled_from(PREFIXES), st.lists(st.integers(1, 3), max_size=10)
)
which = st.integers(0, ROWS - 1)
namespaces = st.integers(0, 2)  # the tree's namespaces (a LoRA adapter's prefixes are its own)

# Examples per run: the profile's, but 100 (Hypothesis' default) under "ci" rather than its 200,
# which doubled the module's time for nothing new: the first 25 examples already run every
# line of cache/, and every line-to-line transition, that the 200 run.
EXAMPLES = {"ci": 100}


@dataclass
class Req:
    req_pool_idx: int | None
    fill_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: TreeNode
    prompt: list[int]
    pending: int = 0  # slots allocated at row[len(fill_ids):] whose KV is not written yet
    cache_namespace: int = 0  # whose cached prefixes it may share


class RadixMachine(RuleBasedStateMachine):
    invariant_checks = 0  # over all examples, for soak-run reports

    def __init__(self) -> None:
        super().__init__()
        self.pool = ReqToTokenPool(ROWS, MAX_CONTEXT)
        self.alloc = TokenToKVPoolAllocator(SIZE)
        self.cache = RadixCache(self.pool, self.alloc)
        self.reqs: list[Req] = []
        self.cached: dict[tuple[int, ...], int] = {}  # (namespace, *prefix) -> last-use stamp
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> (namespace, *the token sequence its KV ends)
        self.tick = 0

    # ---- model ----

    def _touch(self, key: list[int], n: int, ns: int = 0) -> None:
        """Model of match/insert: the prefixes of key[:n] are cached and used now."""
        self.tick += 1
        for i in range(1, n + 1):
            self.cached[(ns, *key[:i])] = self.tick

    def _model_match(self, key: list[int], ns: int = 0) -> int:
        n = 0
        while n < len(key) and (ns, *key[: n + 1]) in self.cached:
            n += 1
        return n

    def _row(self, r: Req) -> torch.Tensor:
        return self.pool.req_to_token[r.req_pool_idx]

    def _pick(self, i: int) -> Req:
        return self.reqs[i % len(self.reqs)]

    def _tree(self) -> Iterator[tuple[TreeNode, list[int]]]:
        """(node, [namespace, *tokens from its root to its end]) for every non-root node."""
        for ns, root in self.cache.roots.items():
            stack = [(child, [ns, *child.key]) for child in root.children.values()]
            while stack:
                node, path = stack.pop()
                yield node, path
                stack.extend((c, path + c.key) for c in node.children.values())

    def _tree_prefixes(self) -> set[tuple[int, ...]]:
        return {
            tuple(path[:i])
            for node, path in self._tree()
            for i in range(len(path) - len(node.key) + 1, len(path) + 1)
        }

    def _locked_prefixes(self) -> set[tuple[int, ...]]:
        return {(r.cache_namespace, *r.fill_ids[:i]) for r in self.reqs for i in range(1, len(r.prefix_indices) + 1)}

    def _evict(self, n: int) -> None:
        before, free_before, evictable = dict(self.cached), self.alloc.available_size(), self.cache.evictable_size()
        freed = self.cache.evict(n)
        after = self._tree_prefixes()
        assert after <= before.keys(), "eviction added prefixes"
        gone = before.keys() - after
        assert freed == len(gone) == self.alloc.available_size() - free_before, (freed, len(gone))
        assert freed >= min(n, evictable), f"evict({n}) freed {freed} of {evictable} evictable"
        locked = self._locked_prefixes()
        assert not gone & locked, "a locked prefix was evicted"
        leaves = after - {t[:-1] for t in after} - locked
        if gone and leaves:
            assert max(before[g] for g in gone) <= min(before[s] for s in leaves), "eviction is not LRU"
        self.cached = {k: v for k, v in before.items() if k in after}

    # ---- the scheduler's moves ----

    @precondition(lambda self: self.pool.available_size() > 0)
    @rule(prompt=prompts, ns=namespaces)
    def start(self, prompt: list[int], ns: int) -> None:
        row = self.pool.alloc()
        assert row is not None
        key = prompt[:-1]  # at least one token is computed
        idx, node = self.cache.match_prefix(key, ns)
        assert len(idx) == self._model_match(key, ns)
        self._touch(key, len(idx), ns)
        self.cache.inc_lock_ref(node)
        self.pool.write(row, 0, idx)
        self.reqs.append(Req(row, prompt[: len(idx)], idx, node, prompt, cache_namespace=ns))

    @precondition(lambda self: self.reqs)
    @rule(i=which, k=st.integers(1, 12))
    def schedule(self, i: int, k: int) -> None:
        """Allocate KV for the next prefill chunk (k tokens) or decode step (1 token)."""
        r = self._pick(i)
        f = len(r.fill_ids)
        k = min(k, len(r.prompt) - f) if f < len(r.prompt) else 1
        if r.pending or f + k > MAX_CONTEXT:
            return
        if self.alloc.available_size() < k:
            self._evict(k - self.alloc.available_size())
        slots = self.alloc.alloc(k)
        if slots is None:
            return
        self._row(r)[f : f + k] = slots.to(torch.int32)
        r.pending = k

    @precondition(lambda self: any(r.pending for r in self.reqs))
    @rule(i=which, tok=st.integers(1, 3))
    def forward(self, i: int, tok: int) -> None:
        """Write the pending slots' KV: prompt tokens, or one output token."""
        r = [r for r in self.reqs if r.pending][i % sum(1 for r in self.reqs if r.pending)]
        f = len(r.fill_ids)
        r.fill_ids = r.fill_ids + (r.prompt[f : f + r.pending] if f < len(r.prompt) else [tok])
        row = self._row(r)
        for j in range(f, f + r.pending):
            self.kv[int(row[j])] = (r.cache_namespace, *r.fill_ids[: j + 1])
        r.pending = 0

    @precondition(lambda self: self.reqs)
    @rule(i=which)
    def cache_unfinished(self, i: int) -> None:
        r = self._pick(i)
        n = len(r.fill_ids)
        self.cache.cache_unfinished_req(r)
        self._touch(r.fill_ids, n, r.cache_namespace)
        assert len(r.prefix_indices) == n

    @precondition(lambda self: self.reqs)
    @rule(i=which)
    def finish(self, i: int) -> None:
        r = self.reqs.pop(i % len(self.reqs))
        f = len(r.fill_ids)
        if r.pending:  # aborted with slots reserved: the caller frees those first
            self.alloc.free(self._row(r)[f : f + r.pending])
        self.cache.cache_finished_req(r)
        self._touch(r.fill_ids, f, r.cache_namespace)
        assert r.req_pool_idx is None

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        self._evict(n)

    @rule(key=prompts, ns=namespaces)
    def match(self, key: list[int], ns: int) -> None:
        idx, node = self.cache.match_prefix(key, ns)
        n = self._model_match(key, ns)
        assert len(idx) == n, f"match {len(idx)} != model {n}"
        assert [self.kv[s] for s in idx.tolist()] == [(ns, *key[: j + 1]) for j in range(n)]
        self._touch(key, n, ns)

    @rule(ns=namespaces)
    def drop(self, ns: int) -> None:
        """An unloaded adapter's prefixes go (none of its requests is running)."""
        if ns == 0 or any(r.cache_namespace == ns for r in self.reqs):
            return
        free = self.alloc.available_size()
        gone = [k for k in self.cached if k[0] == ns]
        assert self.cache.drop_namespace(ns) == len(gone) == self.alloc.available_size() - free
        self.cached = {k: v for k, v in self.cached.items() if k[0] != ns}

    @rule(key=prompts, ns=namespaces)
    def insert(self, key: list[int], ns: int) -> None:
        if self.alloc.available_size() < len(key):
            self._evict(len(key) - self.alloc.available_size())
        slots = self.alloc.alloc(len(key))
        if not key or slots is None:
            return
        for j, s in enumerate(slots.tolist()):
            self.kv[s] = (ns, *key[: j + 1])
        expect = self._model_match(key, ns)
        n = self.cache.insert(key, slots, ns)
        assert n == expect, f"insert reported {n} cached, model {expect}"
        self.alloc.free(slots[:n])
        self._touch(key, len(key), ns)

    @precondition(lambda self: not self.reqs)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.cached.clear()
        assert self.alloc.available_size() == SIZE

    # ---- after every step ----

    @invariant()
    def consistent(self) -> None:
        RadixMachine.invariant_checks += 1
        tails = [self._row(r)[len(r.prefix_indices) : len(r.fill_ids) + r.pending] for r in self.reqs]
        self.cache.check_invariants(torch.cat(tails) if tails else None)
        assert self._tree_prefixes() == self.cached.keys(), "tree content differs from the model"
        locks: Counter[TreeNode] = Counter()
        in_tree = set(self.cache.nodes())
        for r in self.reqs:
            row = self._row(r).tolist()
            p = len(r.prefix_indices)
            assert row[:p] == r.prefix_indices.tolist()
            ns = r.cache_namespace
            assert all(self.kv[row[j]] == (ns, *r.fill_ids[: j + 1]) for j in range(len(r.fill_ids)))
            path, node = [], r.last_node
            while node.parent is not None:
                assert node in in_tree, f"{node} locked by a running request is no longer in the tree"
                locks[node] += 1
                path = node.value.tolist() + path
                node = node.parent
            assert path == r.prefix_indices.tolist(), "prefix_indices differ from the locked path"
        for node, tokens in self._tree():
            assert node.lock_ref == locks[node], f"{node}: lock_ref {node.lock_ref}, running requests {locks[node]}"
            start = len(tokens) - len(node.key)
            for j, s in enumerate(node.value.tolist(), start):
                assert self.kv[s] == tuple(tokens[: j + 1]), f"slot {s} at {j} holds KV of other tokens"


def _soak(test):
    # A soak run outlasts the suite's per-test timeout on purpose.
    return pytest.mark.timeout(0)(test) if PROFILE_NAME == "long" else test


@_soak
def test_radix_cache_state_machine() -> None:
    n0 = RadixMachine.invariant_checks
    run = settings(PROFILE, max_examples=EXAMPLES.get(PROFILE_NAME, PROFILE.max_examples))
    run_state_machine_as_test(RadixMachine, settings=run)
    print(f"{RadixMachine.invariant_checks - n0} invariant checks")
