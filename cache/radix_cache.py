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

Pages are one token, as the allocator's: any prefix can be matched, inserted or
evicted, and a node's children are keyed by the first token of their keys.

Namespaces: each has its own root (namespace 0's is `root`), and a match never leaves
the namespace it starts in, so KV computed under one namespace (a LoRA adapter: the
same tokens, other values) is never served to another. Eviction is LRU over all of
them; a namespace's root goes once its last node is evicted or it is dropped.

The cache never allocates KV slots, never touches KV tensors and never evicts on its
own: the scheduler allocates and calls `evict` when it runs short.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import torch

from .kv_allocator import TokenToKVPoolAllocator
from .req_to_token_pool import ReqToTokenPool

_node_ids = itertools.count()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, compared in C
        return n
    i = 0
    while a[i] == b[i]:  # stops: a mismatch lies before n
        i += 1
    return i


class TreeNode:
    """One edge of the radix tree: `key` token ids, `value` their KV slots (int64)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(self, parent: TreeNode | None, key: list[int], value: torch.Tensor, tick: int) -> None:
        self.children: dict[int, TreeNode] = {}  # keyed by their key's first token
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
    def cache_namespace(self) -> int:
        """Whose cached prefixes it may share (0: the common namespace)."""
        ...

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
        disable: bool = False,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_allocator
        self.disable = disable
        self.device = req_to_token_pool.req_to_token.device
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._tick = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(None, [], self._empty, 0)  # never locked, never evicted
        self.roots: dict[int, TreeNode] = {0: self.root}  # by namespace; every root's parent is None
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
        self.allocator.free(self.slots())
        self._init_tree()

    # ---- reading the whole tree (for resets, checks and failure paths, never hot ones) ----

    def nodes(self) -> Iterator[TreeNode]:
        """Every node below the root, each after its parent. The tree must not change
        while the walk is under way."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def slots(self) -> torch.Tensor:
        """Every KV slot the tree holds, int64 on the CPU. It walks the whole tree: for
        failure paths and checks, never hot ones."""
        return torch.cat([self._empty.cpu(), *(node.value.cpu() for node in self.nodes())])

    # ---- tree operations ----

    @staticmethod
    def _child_key(key: list[int]) -> int:
        """What a node with this key is stored under in its parent's children: its first
        token. For checks and tests; the tree's own operations index key[0] directly."""
        return key[0]

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; return the new upper node, whose only child it becomes."""
        parent = child.parent
        assert parent is not None
        top = TreeNode(parent, child.key[:n], child.value[:n], child.last_access)
        top.lock_ref = child.lock_ref  # every lock through child also passes through top
        parent.children[top.key[0]] = top
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = top
        top.children[child.key[0]] = child
        return top

    def _root(self, namespace: int) -> TreeNode:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = TreeNode(None, [], self._empty, 0)
        return root

    def match_prefix(self, key: Sequence[int], namespace: int = 0) -> MatchResult:
        """The longest cached prefix of `key`, splitting the node where the match ends
        inside it, and marking the matched path as used now (LRU).

        The caller passes at most len(prompt) - 1 tokens, so at least one prompt token is
        always computed: the forward needs it to produce the next token's logits. The match
        is not locked: call `inc_lock_ref(last_node)` before anything can evict."""
        if self.disable:
            return MatchResult(self._empty, self.root)
        key = list(key)
        self._tick += 1
        node = self.roots.get(namespace)
        if node is None:  # nothing cached there: the match ends at a root that need not exist
            return MatchResult(self._empty, self.root)
        values = []
        while key:
            child = node.children.get(key[0])
            if child is None:
                break
            n = _common_prefix_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)  # the next lookup then fails: the loop ends
            self._touch(child)
            values.append(child.value)
            node = child
            key = key[n:]
        return MatchResult(torch.cat(values) if values else self._empty, node)

    def insert(self, key: Sequence[int], value: torch.Tensor, namespace: int = 0) -> int:
        """Cache `value` (KV slots) under `key`; return the length of the prefix that was
        already cached. Those first slots of `value` are NOT taken: the caller still owns
        them and frees those it allocated itself. The rest are the tree's."""
        if self.disable:
            return 0
        if len(key) != len(value):
            raise ValueError(f"insert needs len(key) == len(value), got {len(key)}, {len(value)}")
        if not key:
            return 0
        key = list(key)
        self._tick += 1
        node = self._root(namespace)  # a namespace's root exists only while something is cached under it
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_prefix_len(child.key, key[i:])
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            node = child
            i += n
        if i < len(key):
            leaf = TreeNode(node, key[i:], value[i:].to(self.device, torch.int64, copy=True), self._tick)
            node.children[key[i]] = leaf
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
            del parent.children[node.key[0]]
            self._evictable_leaves.remove(node)
            self._evictable_size -= len(node.key)
            if parent.parent is None:  # a root: another namespace's goes with its last node
                if not parent.children and parent is not self.root:
                    self.roots = {ns: r for ns, r in self.roots.items() if r is not parent}
            elif not parent.children and parent.lock_ref == 0:
                self._add_evictable(parent)
                heap = self._heap  # it may have been rebuilt
        return freed

    def drop_namespace(self, namespace: int) -> int:
        """Free everything cached under a namespace (none of it may be locked); returns the
        tokens freed."""
        root = self.roots.get(namespace)
        if root is None or root is self.root:
            return 0
        nodes = list(self._subtree(root))
        locked = [n for n in nodes if n.lock_ref]
        if locked:
            raise RuntimeError(f"drop_namespace({namespace}) with locked nodes {locked[:4]}")
        for node in nodes:
            self.allocator.free(node.value)
            self._evictable_leaves.discard(node)  # its heap entries go stale
            self._evictable_size -= len(node.key)
        del self.roots[namespace]
        return sum(len(n.key) for n in nodes)

    @staticmethod
    def _subtree(root: TreeNode) -> Iterator[TreeNode]:
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`."""
        while node.parent is not None:
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if not node.children:
                    self._add_evictable(node)
            elif node.lock_ref < 1:
                raise RuntimeError(f"dec_lock_ref below zero on {node}")
            node.lock_ref -= 1
            node = node.parent

    # ---- request hand-off ----

    def cache_finished_req(self, req: CacheableReq) -> None:
        """Hand a finished (or aborted) request's KV to the tree and release its row.

        Reads row[0:len(fill_ids)]; slots the request allocated past len(fill_ids) are not
        seen here: the caller frees them first. Slots already cached (duplicates) that are
        not the request's own prefix_indices are freed. Unlocks `last_node`, frees the row,
        sets req_pool_idx to None."""
        row = req.req_pool_idx
        if row is None:
            raise ValueError("cache_finished_req on a request whose row is already released")
        tokens = req.fill_ids
        if self.disable:
            self.allocator.free(self._row_slots(row, len(tokens)))
        else:
            self._insert_written(req, row, tokens)
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Insert what a running request has written so far (chunked prefill) and make the
        tree the owner of it: duplicates are freed and replaced in the row by the tree's
        slots, the lock moves to the new last node, prefix_indices and last_node are updated,
        so that prefix_indices covers all of fill_ids. A disabled cache leaves the request
        unchanged."""
        if self.disable:
            return
        row = req.req_pool_idx
        if row is None:
            raise ValueError("cache_unfinished_req on a request whose row is already released")
        tokens = req.fill_ids
        n_old = len(req.prefix_indices)
        n_cached = self._insert_written(req, row, tokens)
        # All of it: cached, and nothing evicts in between.
        new_indices, new_last = self.match_prefix(tokens, req.cache_namespace)
        # Past n_cached the row already holds the slots the tree just took.
        self.req_to_token_pool.write(row, n_old, new_indices[n_old:n_cached])
        self.inc_lock_ref(new_last)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = new_last

    def _row_slots(self, row: int, n: int) -> torch.Tensor:
        """A copy of row[0:n], int64: the KV slots of a request's first n tokens."""
        return self.req_to_token_pool.req_to_token[row, :n].to(torch.int64, copy=True)

    def _insert_written(self, req: CacheableReq, row: int, tokens: list[int]) -> int:
        """Insert the KV of `tokens` (req.fill_ids) from the request's row and free the
        request's duplicates; return how many leading tokens were already cached."""
        kv = self._row_slots(row, len(tokens))
        n_cached = self.insert(tokens, kv, req.cache_namespace)
        # kv[:len(prefix_indices)] came from the tree; the rest up to n_cached are the request's duplicates.
        self.allocator.free(kv[len(req.prefix_indices) : n_cached])
        return n_cached

    # ---- checking ----

    def check_invariants(self, running_tail_slots: torch.Tensor | None = None) -> None:
        """Raise AssertionError when an invariant is broken. `running_tail_slots`: the
        slots of all running requests' uncached tails. Walks the whole tree and every slot:
        for tests and an idle scheduler, not for every step.

        Checks: node links; len(key) == len(value) > 0; siblings differ in their first
        token; 0 <= lock_ref(child) <= lock_ref(parent); parents used no earlier than
        children (what makes leaf-first LRU eviction exact); the evictable leaf set and the
        size counters equal a recount (so `evict`, which takes only from that set, never
        takes a locked node); free + evictable + protected + tails == allocator.size, and
        every slot 1..size has exactly one owner, slot 0 none."""
        size = self.allocator.size
        given = running_tail_slots
        tails = self._empty.cpu() if given is None else given.reshape(-1).to("cpu", torch.int64)
        free = self.allocator.free_slots()
        for ns, root in self.roots.items():
            if root.key or root.value.numel() or root.lock_ref or root.parent is not None:
                raise AssertionError(f"namespace {ns}'s root must have no parent, an empty key and value and no lock")
            if ns and not root.children:
                raise AssertionError(f"namespace {ns}'s root is empty: it should have gone")
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        seen: set[TreeNode] = set()
        for node in self.nodes():
            parent = node.parent
            if node in seen:
                raise AssertionError(f"{node} is reached twice: listed under two parents or two keys")
            seen.add(node)
            if len(node.key) != len(node.value) or not node.key:
                raise AssertionError(f"{node}: key {len(node.key)} != value {len(node.value)} or empty")
            # The walk reached node through the children dicts; its parent must list it under
            # its first token, which also makes siblings differ there.
            if parent is None or parent.children.get(self._child_key(node.key)) is not node:
                raise AssertionError(f"{node} is not stored under its first token by its parent {parent}")
            if node.lock_ref < 0 or (parent.parent is not None and parent.lock_ref < node.lock_ref):
                raise AssertionError(f"lock_ref: parent {parent}, child {node}")
            if parent.parent is not None and parent.last_access < node.last_access:
                raise AssertionError(f"LRU: parent {parent} older than child {node}")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
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
        slots = torch.cat([free, tails, self.slots()])
        if slots.numel() and (slots.min() < 1 or slots.max() > size):
            raise AssertionError(f"slot out of 1..{size} (slot 0 is padding): min {slots.min()}, max {slots.max()}")
        counts = torch.bincount(slots, minlength=size + 1)
        twice = (counts > 1).nonzero().flatten()
        if twice.numel():
            raise AssertionError(f"slots with more than one owner: {twice[:16].tolist()}")
        missing = (counts[1:] == 0).nonzero().flatten() + 1
        if missing.numel():
            raise AssertionError(f"slots with no owner (leaked): {missing[:16].tolist()}")
