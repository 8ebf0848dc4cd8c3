"""The radix prefix cache: a radix tree over token ids whose nodes hold the KV slot
indices of those tokens, so that requests sharing a prompt prefix share its KV.

Ownership. Every usable KV slot (1..allocator.size) has exactly one owner:
- the allocator's free list;
- the tree: the slots in node values. A node is protected while some request
  locks it (lock_ref > 0, counted in `protected_size`), evictable otherwise;
- a running request: the slots in its req_to_token row at positions
  [len(req.prefix_indices), n_alloc), its uncached tail, where n_alloc counts the
  positions it has allocated (computed or only reserved). Positions
  [0, len(req.prefix_indices)) hold tree slots that the request has locked through
  `req.last_node`; the request never frees those, the tree does, on eviction.
`cache_unfinished_req` moves slots from a request's tail to the tree;
`cache_finished_req` moves them to the tree or the free list and releases the row.

The cache never allocates KV slots, never touches KV tensors and never evicts on its
own: the scheduler allocates and calls `evict` when it runs short.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from .kv_allocator import TokenToKVPoolAllocator
from .req_to_token_pool import ReqToTokenPool

_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree: `key` token ids, `value` their KV slots (int64)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(self, parent: TreeNode | None, key: list[int], value: torch.Tensor, tick: int) -> None:
        # Children are keyed by their first token (page_size 1) or first page (a tuple).
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = tick
        self.id = next(_node_ids)  # breaks LRU ties deterministically

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access})"


class MatchResult(NamedTuple):
    indices: torch.Tensor  # int64 KV slots of the matched prefix
    last_node: TreeNode  # the node where the match ends (root when nothing matched)


class CacheableReq(Protocol):
    """What the cache needs from a scheduler request."""

    req_pool_idx: int | None  # its req_to_token row; None once released

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV is written in the row: prompt + outputs so far."""
        ...

    prefix_indices: torch.Tensor  # KV slots of row[0:len] owned by the tree, locked by this req
    last_node: TreeNode  # the locked node that ends prefix_indices' path


class RadixCache:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        disable: bool = False,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_allocator
        self.page_size = page_size
        self.disable = disable
        self.device = req_to_token_pool.req_to_token.device
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._tick = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(None, [], self._empty, 0)  # never locked, never evicted
        # Invariant: exactly the non-root nodes with no children and lock_ref == 0.
        self._evictable_leaves: set[TreeNode] = set()
        # A heap over them by (last_access, id), kept across evictions: each time a node
        # becomes an evictable leaf or an evictable leaf is touched, an entry is pushed;
        # an entry is stale once its node left the set or was touched again (skipped on
        # pop), and the heap is rebuilt when stale entries outnumber live ones.
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._evictable_size = 0
        self._protected_size = 0

    # ---- sizes ----

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def reset(self) -> None:
        """Empty the tree and give its slots back to the allocator. Only with no request
        holding a lock; call it before (or instead of) `allocator.clear()`."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} tokens locked by running requests")
        values = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                values.append(child.value)
                stack.append(child)
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()

    # ---- tree operations ----

    def _child_key(self, key: list[int]) -> int | tuple[int, ...]:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of a and b, in whole pages."""
        n = min(len(a), len(b))
        if a[:n] == b[:n]:
            return n
        p = self.page_size
        i = 0
        while a[i : i + p] == b[i : i + p]:  # stops: a mismatch lies before n
            i += p
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; return the new upper node, whose only child it becomes."""
        parent = child.parent
        assert parent is not None
        top = TreeNode(parent, child.key[:n], child.value[:n], child.last_access)
        top.lock_ref = child.lock_ref  # every lock through child also passes through top
        parent.children[self._child_key(top.key)] = top
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = top
        top.children[self._child_key(child.key)] = child
        return top

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """The longest cached prefix of `key` (whole pages only), splitting the node where
        the match ends inside it, and marking the matched path as used now (LRU).

        The caller passes at most len(prompt) - 1 tokens, so at least one prompt token is
        always computed: the forward needs it to produce the next token's logits. The match
        is not locked: call `inc_lock_ref(last_node)` before anything can evict."""
        if self.disable:
            return MatchResult(self._empty, self.root)
        key = list(key[: len(key) // self.page_size * self.page_size])
        self._tick += 1
        node = self.root
        values = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)  # the next lookup then fails: the loop ends
            self._touch(child)
            values.append(child.value)
            node = child
            key = key[n:]
        return MatchResult(torch.cat(values) if values else self._empty, node)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Cache `value` (KV slots) under `key` (whole pages); return the length of the
        prefix that was already cached. Those first slots of `value` are NOT taken: the
        caller still owns them and frees those it allocated itself. The rest are the tree's."""
        if self.disable:
            return 0
        if len(key) != len(value) or len(key) % self.page_size:
            raise ValueError(f"insert needs len(key) == len(value), whole pages; got {len(key)}, {len(value)}")
        key = list(key)
        self._tick += 1
        node = self.root
        i = 0
        while i < len(key):
            child = node.children.get(self._child_key(key[i:]))
            if child is None:
                break
            n = self._match_len(child.key, key[i:])
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            node = child
            i += n
        if i < len(key):
            leaf = TreeNode(node, key[i:], value[i:].to(self.device, torch.int64, copy=True), self._tick)
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable_leaves.discard(node)
            self._add_evictable(leaf)
            self._evictable_size += len(leaf.key)
        return i

    def _touch(self, node: TreeNode) -> None:
        node.last_access = self._tick
        if node in self._evictable_leaves:
            heapq.heappush(self._heap, (node.last_access, node.id, node))

    def _add_evictable(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node)
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 2 * len(self._evictable_leaves) + 64:
            self._heap = [(n.last_access, n.id, n) for n in self._evictable_leaves]
            heapq.heapify(self._heap)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (fewer if not enough are evictable) by
        dropping least recently used unlocked leaves; return how many were freed."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = self._heap
        freed = 0
        while freed < num_tokens and heap:
            access, _, node = heapq.heappop(heap)
            if node not in self._evictable_leaves or access != node.last_access:
                continue  # stale: the node was locked, evicted or touched since
            parent = node.parent
            assert parent is not None
            self.allocator.free(node.value)
            freed += len(node.key)
            del parent.children[self._child_key(node.key)]
            self._evictable_leaves.remove(node)
            self._evictable_size -= len(node.key)
            if not parent.children and parent.lock_ref == 0 and parent is not self.root:
                self._add_evictable(parent)
                heap = self._heap  # it may have been rebuilt
        return freed

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`."""
        while node is not self.root:
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if not node.children:
                    self._add_evictable(node)
            elif node.lock_ref < 1:
                raise RuntimeError(f"dec_lock_ref below zero on {node}")
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    # ---- request hand-off ----

    def cache_finished_req(self, req: CacheableReq) -> None:
        """Hand a finished (or aborted) request's KV to the tree and release its row.

        Reads row[0:len(fill_ids)]; slots the request allocated past len(fill_ids) are not
        seen here: the caller frees them first. Whole pages are inserted; slots already
        cached (duplicates) that are not the request's own prefix_indices are freed, as is
        an unaligned tail. Unlocks `last_node`, frees the row, sets req_pool_idx to None."""
        row = req.req_pool_idx
        if row is None:
            raise ValueError("cache_finished_req on a request whose row is already released")
        n = len(req.fill_ids)
        kv = self.req_to_token_pool.req_to_token[row, :n].to(torch.int64, copy=True)
        if self.disable:
            self.allocator.free(kv)
        else:
            aligned = n // self.page_size * self.page_size
            self.allocator.free(kv[aligned:])
            n_cached = self.insert(req.fill_ids[:aligned], kv[:aligned])
            # kv[:len(prefix_indices)] came from the tree; the rest up to n_cached are our duplicates.
            self.allocator.free(kv[len(req.prefix_indices) : n_cached])
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Insert what a running request has written so far (chunked prefill) and make the
        tree the owner of it: duplicates are freed and replaced in the row by the tree's
        slots, the lock moves to the new last node, prefix_indices and last_node are updated.

        With page_size > 1 the unaligned tail row[len(prefix_indices):len(fill_ids)] stays
        the request's (uncached tail), so the next chunk starts at len(fill_ids), which can
        exceed len(prefix_indices). A disabled cache leaves the request unchanged."""
        if self.disable:
            return
        row = req.req_pool_idx
        if row is None:
            raise ValueError("cache_unfinished_req on a request whose row is already released")
        aligned = len(req.fill_ids) // self.page_size * self.page_size
        key = req.fill_ids[:aligned]
        kv = self.req_to_token_pool.req_to_token[row, :aligned].to(torch.int64, copy=True)
        n_old = len(req.prefix_indices)
        n_cached = self.insert(key, kv)
        self.allocator.free(kv[n_old:n_cached])
        new_indices, new_last = self.match_prefix(key)  # all of key: it is cached and nothing evicts in between
        # Past n_cached the row already holds the slots the tree just took.
        self.req_to_token_pool.write(row, n_old, new_indices[n_old:n_cached])
        self.inc_lock_ref(new_last)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = new_last

    # ---- checking ----

    def check_invariants(self, running_tail_slots: torch.Tensor | None = None) -> None:
        """Raise AssertionError when an invariant is broken. `running_tail_slots`: the
        slots of all running requests' uncached tails. Walks the whole tree and every slot:
        for tests and an idle scheduler, not for every step.

        Checks: node links; len(key) == len(value) > 0, whole pages; siblings differ in
        their first token (page); 0 <= lock_ref(child) <= lock_ref(parent); parents used
        no earlier than children (what makes leaf-first LRU eviction exact); the evictable
        leaf set and the size counters equal a recount (so `evict`, which takes only from
        that set, never takes a locked node); free + evictable + protected + tails ==
        allocator.size, and every slot 1..size has exactly one owner, slot 0 none."""
        size = self.allocator.size
        given = running_tail_slots
        tails = self._empty.cpu() if given is None else given.reshape(-1).to("cpu", torch.int64)
        free = self.allocator.free_slots()
        if self.root.key or self.root.value.numel() or self.root.lock_ref:
            raise AssertionError("the root must have an empty key and value and no lock")
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        owned = [free, tails]
        stack = [self.root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                if child.parent is not node:
                    raise AssertionError(f"{child} is a child of {node} but points to {child.parent}")
                if len(child.key) != len(child.value) or not child.key:
                    raise AssertionError(f"{child}: key {len(child.key)} != value {len(child.value)} or empty")
                if len(child.key) % self.page_size:
                    raise AssertionError(f"{child}: key of {len(child.key)} tokens is not whole pages")
                if ck != self._child_key(child.key):
                    # Children are stored by first token/page, so this also makes siblings differ there.
                    raise AssertionError(
                        f"{child} stored under {ck!r} but its key starts {self._child_key(child.key)!r}"
                    )
                if child.lock_ref < 0 or (node is not self.root and node.lock_ref < child.lock_ref):
                    raise AssertionError(f"lock_ref: parent {node}, child {child}")
                if node is not self.root and node.last_access < child.last_access:
                    raise AssertionError(f"LRU: parent {node} older than child {child}")
                if child.lock_ref:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                    if not child.children:
                        leaves.add(child)
                owned.append(child.value)
                stack.append(child)
        if leaves != self._evictable_leaves:
            raise AssertionError(f"evictable leaf set: missing {leaves - self._evictable_leaves}, "
                                 f"extra {self._evictable_leaves - leaves}")
        live = {n for a, _, n in self._heap if a == n.last_access}
        if leaves - live:
            raise AssertionError(f"evictable leaves without a live eviction-heap entry: {leaves - live}")
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            raise AssertionError(
                f"counters (evictable, protected)={self._evictable_size, self._protected_size}, "
                f"recount={evictable, protected}"
            )
        if free.numel() + evictable + protected + tails.numel() != size:
            raise AssertionError(
                f"free {free.numel()} + evictable {evictable} + protected {protected} + tails {tails.numel()} != {size}"
            )
        slots = torch.cat([s.reshape(-1).to("cpu", torch.int64) for s in owned])
        if slots.numel() and (slots.min() < 1 or slots.max() > size):
            raise AssertionError(f"slot out of 1..{size} (slot 0 is padding): min {slots.min()}, max {slots.max()}")
        counts = torch.bincount(slots, minlength=size + 1)
        twice = (counts > 1).nonzero().flatten()
        if twice.numel():
            raise AssertionError(f"slots with more than one owner: {twice[:16].tolist()}")
        missing = (counts[1:] == 0).nonzero().flatten() + 1
        if missing.numel():
            raise AssertionError(f"slots with no owner (leaked): {missing[:16].tolist()}")
