"""Unit tests of the radix prefix cache's tricky cases."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from sgl.cache.kv_allocator import TokenToKVPoolAllocator
from sgl.cache.radix_cache import RadixCache, TreeNode
from sgl.cache.req_to_token_pool import ReqToTokenPool


@dataclass
class Req:
    req_pool_idx: int | None
    fill_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: TreeNode
    tail: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    cache_namespace: int = 0  # whose cached prefixes it may share


def make(size: int = 32, disable: bool = False) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator, RadixCache]:
    pool = ReqToTokenPool(4, 64)
    alloc = TokenToKVPoolAllocator(size)
    return pool, alloc, RadixCache(pool, alloc, disable=disable)


def put(alloc: TokenToKVPoolAllocator, cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with fresh slots, freeing the duplicates as a caller must."""
    slots = alloc.alloc(len(key))
    assert slots is not None
    n = cache.insert(key, slots)
    alloc.free(slots[:n])
    return slots


def start(pool: ReqToTokenPool, alloc: TokenToKVPoolAllocator, cache: RadixCache, prompt: list[int]) -> Req:
    """Admit and fully prefill a request the way the scheduler does."""
    row = pool.alloc()
    assert row is not None
    idx, node = cache.match_prefix(prompt[:-1])
    cache.inc_lock_ref(node)
    new = alloc.alloc(len(prompt) - len(idx))
    assert new is not None
    pool.write(row, 0, torch.cat([idx, new]))
    return Req(row, list(prompt), idx, node, new)


def test_split_mid_node() -> None:
    pool, alloc, cache = make()
    slots = put(alloc, cache, [1, 2, 3, 4, 5])
    idx, node = cache.match_prefix([1, 2, 3])
    assert idx.tolist() == slots[:3].tolist() and node.key == [1, 2, 3]
    assert len(cache.root.children) == 1 and list(node.children.values())[0].key == [4, 5]
    idx, node = cache.match_prefix([1, 2, 9, 9])
    assert idx.tolist() == slots[:2].tolist() and node.key == [1, 2]
    assert cache.total_size() == 5 and cache.evictable_size() == 5
    cache.check_invariants()


def test_split_of_locked_node_keeps_lock() -> None:
    pool, alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    _, leaf = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(leaf)
    _, top = cache.match_prefix([1, 2])
    assert top.lock_ref == 1 and leaf.lock_ref == 1 and leaf.parent is top
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.check_invariants()
    cache.dec_lock_ref(leaf)
    assert cache.protected_size() == 0 and cache.evict(100) == 4
    cache.check_invariants()


def test_duplicate_insert_frees_slots() -> None:
    pool, alloc, cache = make()
    assert cache.insert([1, 2, 3], torch.tensor([5, 6, 7])) == 0
    assert cache.insert([1, 2, 3, 4], torch.tensor([8, 9, 10, 11])) == 3
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == [5, 6, 7, 11]
    pool, alloc, cache = make()
    # Two requests computed the same prompt without sharing: the second one's copy is freed.
    a = start(pool, alloc, cache, [1, 2, 3, 4])
    b = start(pool, alloc, cache, [1, 2, 3, 4])
    cache.check_invariants(torch.cat([a.tail, b.tail]))
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)
    assert cache.total_size() == 4 and alloc.available_size() == 28
    cache.check_invariants()
    # A request on a cached prefix frees only its own duplicates, never the tree's slots.
    c = start(pool, alloc, cache, [1, 2, 3, 4, 5])
    assert len(c.prefix_indices) == 4
    d = start(pool, alloc, cache, [1, 2, 3, 4, 5])
    cache.cache_finished_req(c)
    cache.cache_finished_req(d)
    assert cache.total_size() == 5 and alloc.available_size() == 27
    cache.check_invariants()


def test_unfinished_req_takes_ownership_and_moves_lock() -> None:
    pool, alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    req = start(pool, alloc, cache, [1, 2, 3, 4, 5, 6])  # matched [1, 2, 3]
    other = start(pool, alloc, cache, [1, 2, 3, 4, 5, 7])  # computes 4, 5 too
    cache.cache_unfinished_req(other)
    cache.cache_unfinished_req(req)  # its 4, 5 are duplicates now: freed, row rewritten
    assert req.prefix_indices.tolist() == (
        other.prefix_indices[:5].tolist() + [pool.req_to_token[req.req_pool_idx, 5].item()]
    )
    assert pool.req_to_token[req.req_pool_idx, :6].tolist() == req.prefix_indices.tolist()
    assert req.last_node.key == [6] and req.last_node.lock_ref == 1 and req.last_node.parent.lock_ref == 2
    cache.check_invariants()
    cache.cache_finished_req(req)
    cache.cache_finished_req(other)
    assert cache.protected_size() == 0 and cache.total_size() == 7
    cache.check_invariants()


def test_eviction_order_is_lru() -> None:
    pool, alloc, cache = make()
    put(alloc, cache, [1, 1])
    put(alloc, cache, [2, 2])
    put(alloc, cache, [3, 3, 3])
    cache.match_prefix([1, 1])  # 1 is now the most recently used
    assert cache.evict(1) == 2 and 2 not in cache.root.children
    assert cache.evict(1) == 3 and 3 not in cache.root.children
    assert 1 in cache.root.children
    cache.check_invariants()


def test_evicting_a_leaf_exposes_its_parent() -> None:
    pool, alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])  # [1, 2] -> [3], [4]
    put(alloc, cache, [5])
    cache.match_prefix([5])
    assert cache.evict(3) == 4  # [3] and [4] first, then their parent [1, 2], whole
    assert list(cache.root.children) == [5] and alloc.available_size() == 31
    cache.check_invariants()


def test_locked_node_never_evicted() -> None:
    pool, alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 1  # only [4]
    assert cache.match_prefix([1, 2, 3]).last_node is node and cache.evictable_size() == 0
    assert cache.protected_size() == 3
    cache.check_invariants()
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 3 and cache.evict(100) == 3
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)


def test_disabled_mode() -> None:
    pool, alloc, cache = make(disable=True)
    assert cache.insert([1, 2], torch.tensor([1, 2])) == 0
    req = start(pool, alloc, cache, [1, 2, 3])
    assert len(req.prefix_indices) == 0 and req.last_node is cache.root
    cache.cache_unfinished_req(req)
    assert len(req.prefix_indices) == 0
    cache.check_invariants(req.tail)
    cache.cache_finished_req(req)
    assert alloc.available_size() == 32 and pool.available_size() == 4 and req.req_pool_idx is None
    assert cache.total_size() == 0 and cache.evict(10) == 0 and len(cache.match_prefix([1, 2, 3]).indices) == 0
    cache.check_invariants()


def test_reset_returns_slots() -> None:
    pool, alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    req = start(pool, alloc, cache, [1, 2, 3, 4])
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.cache_finished_req(req)
    cache.reset()
    assert alloc.available_size() == 32 and cache.total_size() == 0
    cache.check_invariants()


def test_nodes_and_slots_cover_the_tree() -> None:
    pool, alloc, cache = make()
    assert list(cache.nodes()) == [] and cache.slots().tolist() == []
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 5])
    put(alloc, cache, [1, 2, 5, 6, 7])
    put(alloc, cache, [8])
    nodes = list(cache.nodes())
    assert sorted(tuple(n.key) for n in nodes) == [(1, 2), (3, 4), (5,), (6, 7), (8,)]
    for i, node in enumerate(nodes):  # each after its parent
        assert node.parent is cache.root or node.parent in nodes[:i]
    slots = cache.slots()
    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert sorted(slots.tolist()) == sorted(s for n in nodes for s in n.value.tolist())
    assert len(slots) == cache.total_size() == 8
    assert cache.evict(3) == 4  # [3, 4], then [6, 7]
    assert sorted(cache.slots().tolist()) == sorted(s for n in cache.nodes() for s in n.value.tolist())
    assert len(cache.slots()) == cache.total_size() == 4


def test_check_invariants_catches_leak_and_double_owner() -> None:
    pool, alloc, cache = make()
    put(alloc, cache, [1, 2])
    leaked = alloc.alloc(1)
    with pytest.raises(AssertionError, match="free .* != 32"):
        cache.check_invariants()
    assert leaked is not None
    with pytest.raises(AssertionError, match="more than one owner"):
        cache.check_invariants(torch.cat([leaked[:0], cache.root.children[1].value[:1]]))
    cache.check_invariants(leaked)


@pytest.mark.parametrize("break_link", ["wrong key", "wrong parent", "two parents"])
def test_check_invariants_catches_broken_links(break_link: str) -> None:
    pool, alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [4, 5])
    a, b = cache.root.children[1], cache.root.children[4]
    cache.check_invariants()
    if break_link == "wrong key":
        cache.root.children[9] = cache.root.children.pop(4)
    elif break_link == "wrong parent":
        b.parent = a
    else:
        a.children[4] = b
    with pytest.raises(AssertionError, match="first token|reached twice"):
        cache.check_invariants()
