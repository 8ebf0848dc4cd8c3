"""Prefill admission alone (sgl.sched.prefill.PrefillAdder), on real host
pools and a real radix cache, no model: the chunk and the budget bound a round,
a long prompt is chunked and continues round after round, a request whose prefix
another prefill is computing waits, running requests' reserve blocks admission
(a lone request goes without one), and every radix lock taken for a request
that is not admitted is given back. A Hypothesis property runs random rounds."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from sgl.cache.pools import build_kv_pools
from sgl.core.protocol import GenerateReqInput
from sgl.core.sampling_params import SamplingParams
from sgl.sched.batch import ScheduleBatch
from sgl.sched.kv_cache import KVCache
from sgl.sched.prefill import CLIP_MAX_NEW_TOKENS, IN_BATCH_PREFIX_MIN, PrefillAdder, Verdict, prompt_logprob_rows
from sgl.sched.req import Req
from tests.hypothesis_profiles import PROFILE


class Pools(KVCache):
    """A KVCache whose parts unpack as (pool, allocator, tree)."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.pool, self.allocator, self.tree))

    def __getitem__(self, i: int) -> Any:
        return (self.pool, self.allocator, self.tree)[i]


def make(kv: int = 1000, rows: int = 8, ctx: int = 512, disable: bool = False) -> Pools:
    p = build_kv_pools(1, 1, 1, torch.float32, torch.device("cpu"), ctx, max_total_tokens=kv, max_running_requests=rows)
    assert (p.max_total_tokens, p.max_running_requests) == (kv, rows)
    return Pools(p.req_to_token_pool, p.allocator, disable)


def adder(pools: Pools, *, running: Sequence[Req] = (), prefilling: Sequence[Req] = (),
          rids: dict[str, Req] | None = None, budget: int = 16384, chunk: int = 4096, max_running: int = 256,
          ratio: float = 0.7, lp_rows: int = 1 << 20) -> PrefillAdder:
    return PrefillAdder(pools, running=running, prefilling=prefilling, rids=rids or {},
                        max_prefill_tokens=budget, chunk_size=chunk, logprob_rows=lp_rows,
                        max_running_requests=max_running, new_token_ratio=ratio)


def req(rid: str, ids: list[int], max_new: int = 8, **msg: object) -> Req:
    sp = SamplingParams(max_new_tokens=max_new)
    return Req(rid, ids, sp, False, GenerateReqInput(rid, ids, sp, **msg))  # type: ignore[arg-type]


def cache(pools: Pools, key: list[int]) -> None:
    """Put `key` in the tree with fresh slots, as a finished request leaves it."""
    _, alloc, tree = pools
    slots = alloc.alloc(len(key))
    assert slots is not None
    n = len(key) if tree.disable else tree.insert(key, slots)  # a disabled tree takes nothing
    alloc.free(slots[:n])


def build(pools: Pools, a: PrefillAdder) -> ScheduleBatch:
    """What the scheduler does with a round's admissions: allocate and write them."""
    pool, alloc, tree = pools
    total = sum(r.extend_len for r in a.admitted)
    tree.evict(total - alloc.available_size())
    loc = alloc.alloc(total)
    assert loc is not None
    return ScheduleBatch.extend(a.admitted, loc, pool)


def unlock(pools: Pools, reqs: Sequence[Req]) -> None:
    for r in reqs:
        pools[2].dec_lock_ref(r.last_node)


def test_chunk_bounds_the_round_and_budget_is_checked_before_each_request() -> None:
    pools = make()
    reqs = [req(f"r{i}", [i + 1] * 30) for i in range(5)]
    a = adder(pools, chunk=70)
    a.add_waiting(reqs, "fcfs")
    assert [r.extend_len for r in a.admitted] == [30, 30, 10] and a.chunked_req is reqs[2]
    assert a.chunk_left == 0
    b = adder(make(), budget=40)
    b.add_waiting([req(f"s{i}", [i + 1] * 30) for i in range(5)], "fcfs")
    # Budget left before each request: the second starts with 10 left and goes whole.
    assert [r.extend_len for r in b.admitted] == [30, 30] and b.budget == -20 and b.chunked_req is None
    assert b.add_one(req("late", [9] * 5)) is Verdict.FULL


LOGPROBS = {"return_logprob": True, "logprob_start_len": 0}


def test_prompt_logprob_rows_are_bounded_apart_from_the_chunk() -> None:
    """Requests asking for prompt logprobs take at most the round's logprob rows; others
    are not held to them, and a round with none left ends at the next logprob request."""
    a = adder(make(), chunk=100, lp_rows=40)
    first, second = req("a", [1] * 30, **LOGPROBS), req("b", [2] * 30, **LOGPROBS)
    a.add_waiting([req("plain", [3] * 25), first, second], "fcfs")
    assert [r.extend_len for r in a.admitted] == [25, 30, 10] and a.chunked_req is second
    b = adder(make(), chunk=100, lp_rows=30)
    b.add_waiting([req("a", [1] * 30, **LOGPROBS), req("c", [4] * 5, **LOGPROBS), req("plain", [3] * 25)], "fcfs")
    assert [r.rid for r in b.admitted] == ["a"] and b.logprob_rows_left == 0
    assert [prompt_logprob_rows(v, 16384) for v in (151936, 49152, 1024)] == [3533, 10922, 16384]
    assert prompt_logprob_rows(1 << 40, 100) == 1  # a round always makes progress


def test_request_slots_and_rows_end_the_round() -> None:
    a = adder(make(), running=[req("run", [1, 2])], max_running=3)
    a.add_waiting([req(f"r{i}", [i + 5] * 4) for i in range(4)], "fcfs")
    assert len(a.admitted) == 2
    pools = make(rows=2)
    b = adder(pools)
    b.add_waiting([req(f"r{i}", [i + 5] * 4) for i in range(4)], "fcfs")
    assert len(b.admitted) == 2 and pools[0].available_size() == 0


def test_long_prompt_is_chunked_round_after_round() -> None:
    pools = make()
    long = req("long", list(range(1, 101)))
    a = adder(pools, chunk=16)
    assert a.add_one(long) is Verdict.CHUNKED and a.chunked_req is long and long.extend_len == 16
    assert a.claimed == 16  # a chunk that does not end the prompt claims no reserve
    build(pools, a)
    done = 16
    while True:
        a = adder(pools, chunk=16, prefilling=[long])
        assert a.add_chunked(long)
        done += long.extend_len
        # The chunks written so far went to the tree, locked by the request itself.
        assert len(long.prefix_indices) == done - long.extend_len
        waiting = [req("other", [7] * 5)]
        a.add_waiting(waiting, "fcfs")
        build(pools, a)
        if a.chunked_req is None:
            break
        assert a.admitted == [long]  # the chunk takes the round: nobody else joins
    assert done == 100 and long.kv_len == 100 and long.extend_len == 4
    assert [r.rid for r in a.admitted] == ["long", "other"]  # the last chunk leaves room for others


def test_aborted_or_unfitting_chunked_request_takes_no_round() -> None:
    pools = make(kv=40)
    long = req("long", list(range(1, 101)))
    a = adder(pools, chunk=30)
    assert a.add_one(long) is Verdict.CHUNKED
    build(pools, a)
    a = adder(pools, chunk=30)
    assert not a.add_chunked(long) and a.admitted == []  # 30 more tokens, 10 slots left
    long.to_abort = "gone"
    assert not adder(pools).add_chunked(long)


def test_prefix_in_flight_defers_a_sibling() -> None:
    shared = list(range(1, 1 + IN_BATCH_PREFIX_MIN + 8))
    first = req("first", shared + [900, 901])
    sibling = req("sibling", shared + [902])
    short = req("short", shared[: IN_BATCH_PREFIX_MIN - 1] + [903, 904])
    a = adder(make())
    assert a.add_one(first) is Verdict.ADMITTED
    assert a.add_one(sibling) is Verdict.DEFERRED and sibling.req_pool_idx is None
    assert a.add_one(short) is Verdict.ADMITTED  # shares too little to wait for
    # In flight from an earlier round counts the same; a disabled tree never waits.
    assert adder(make(), prefilling=[first]).add_one(req("b", shared + [5])) is Verdict.DEFERRED
    assert adder(make(disable=True), prefilling=[first]).add_one(req("c", shared + [5])) is Verdict.ADMITTED
    # Prompt logprobs need their own logits: such a request never waits for a cached prefix.
    lp = req("lp", shared + [6], return_logprob=True, logprob_start_len=0)
    assert adder(make(), prefilling=[first]).add_one(lp) is Verdict.ADMITTED


def test_sibling_waits_for_its_leader() -> None:
    lead = req("lead", [1, 2, 3, 4])
    lead.is_leader = True
    follower = req("follower", [1, 2, 3, 4], prefix_leader="lead")
    a = adder(make(), rids={"lead": lead})
    assert a.add_one(follower) is Verdict.DEFERRED
    lead.is_leader = False
    assert a.add_one(follower) is Verdict.ADMITTED


def test_reserve_blocks_admission_only_beside_others() -> None:
    running = [req("run", [1, 2], max_new=1000)]
    waiting = req("w", [3] * 60, max_new=100)
    a = adder(make(kv=1100), running=running, ratio=1.0)
    assert a.reserved == 1000 and a.room() == 100
    assert a.add_one(waiting) is Verdict.NO_ROOM  # 60 + 100 reserve > 100
    assert adder(make(kv=1100), ratio=1.0).add_one(waiting) is Verdict.ADMITTED
    # Alone, a request goes without its reserve once its own tokens fit; the next one waits.
    pools = make(kv=100)
    a = adder(pools, ratio=1.0)
    assert a.add_one(req("alone", [4] * 60, max_new=100)) is Verdict.ADMITTED and a.room() == -60
    assert a.add_one(req("next", [5] * 2, max_new=1)) is Verdict.NO_ROOM
    assert adder(make(kv=100)).add_one(req("huge", [6] * 101)) is Verdict.NO_ROOM  # never fits now
    # The reserve of a running request is clipped.
    assert adder(make(), running=[req("long", [1], max_new=10**6)], ratio=1.0).reserved == CLIP_MAX_NEW_TOKENS


def test_locks_are_given_back_for_requests_not_admitted() -> None:
    pools = make(kv=100)
    _, _, tree = pools
    a_key, b_key = list(range(1, 31)), list(range(101, 131))
    cache(pools, a_key)
    cache(pools, b_key)
    a = adder(pools, running=[req("run", [1], max_new=30)], ratio=1.0)
    hit = req("hit", a_key + [99], max_new=4)
    assert a.add_one(hit) is Verdict.ADMITTED and len(hit.prefix_indices) == 30 and a.cached_tokens == 30
    assert (tree.protected_size(), tree.evictable_size()) == (30, 30)
    # Matches the other prefix, locks it (no longer evictable room), does not fit:
    # unlocked again, no row taken.
    miss = req("miss", b_key + [98] * 40, max_new=4)
    assert a.add_one(miss) is Verdict.NO_ROOM
    assert (tree.protected_size(), tree.evictable_size()) == (30, 30)
    assert miss.req_pool_idx is None and miss.last_node is None and pools[0].available_size() == 7
    tree.check_invariants()
    unlock(pools, a.admitted)
    assert tree.protected_size() == 0
    tree.check_invariants()


@st.composite
def prompts(draw: st.DrawFn, base: list[int]) -> list[int]:
    """A prompt sharing some of `base` (so prefixes match in the tree and in flight)."""
    ids = base[: draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(1, 4), max_size=20))
    return ids or [1]


@PROFILE
@given(
    data=st.data(),
    base=st.lists(st.integers(1, 4), min_size=60, max_size=60),
    running=st.lists(st.integers(1, 150), max_size=3),
    kv=st.integers(60, 600),
    rows=st.integers(1, 8),
    budget=st.integers(1, 200),
    chunk=st.integers(1, 120),
    lp_rows=st.integers(1, 120),
    max_running=st.integers(1, 12),
    ratio=st.floats(0.1, 1.0),
    policy=st.sampled_from(["fcfs", "lpm"]),
    disable=st.booleans(),
)
def test_random_rounds_keep_every_limit(data: st.DataObject, base: list[int], running: list[int], kv: int,
                                        rows: int, budget: int, chunk: int, lp_rows: int, max_running: int,
                                        ratio: float, policy: str, disable: bool) -> None:
    cached = data.draw(st.lists(prompts(base), max_size=3))
    waiting = data.draw(st.lists(st.tuples(prompts(base), st.integers(0, 100), st.booleans()), min_size=1, max_size=8))
    pools = make(kv=kv, rows=rows, disable=disable)
    pool, alloc, tree = pools
    for key in cached:
        if len(key) <= alloc.available_size():
            cache(pools, key)
    queue = [req(f"w{i}", ids, max_new=m, **(LOGPROBS if lp else {})) for i, (ids, m, lp) in enumerate(waiting)]
    run = [req(f"r{i}", [1], max_new=m) for i, m in enumerate(running)]
    a = adder(pools, running=run, budget=budget, chunk=chunk, max_running=max_running, ratio=ratio, lp_rows=lp_rows)
    free, evictable = alloc.available_size(), tree.evictable_size()
    a.add_waiting(queue, policy)
    ext = [r.extend_len for r in a.admitted]
    assert sum(ext) <= chunk and sum(ext[:-1]) < budget  # each admission began with budget left
    assert sum(r.extend_len for r in a.admitted if r.needs_input_logprobs) <= lp_rows
    assert len(a.admitted) + len(run) <= max(max_running, len(run)) and len(a.admitted) <= rows
    assert pool.available_size() == rows - len(a.admitted)
    # What is admitted fits; the reserve holds unless one request went alone.
    assert sum(ext) <= a.available() <= free + evictable
    assert not a.admitted or a.room() >= 0 or (not run and len(a.admitted) == 1)
    assert {r.rid for r in a.admitted} == {r.rid for r in queue if r.req_pool_idx is not None}
    for r in a.admitted:
        whole = r.kv_len + r.extend_len == r.seq_len
        assert whole == (r is not a.chunked_req) and r.kv_len == len(r.prefix_indices) < r.seq_len
    assert a.chunked_req is None or a.chunked_req is a.admitted[-1]
    for r in queue:
        if r.req_pool_idx is None:
            assert r.last_node is None and r.kv_len == 0
    tree.check_invariants()
    if a.admitted:
        build(pools, a)  # the allocation after admission cannot fail
    tails = [pool.req_to_token[r.req_pool_idx, len(r.prefix_indices) : r.kv_len] for r in a.admitted]
    tails_t = torch.cat(tails) if tails else None
    tree.check_invariants(tails_t)
    unlock(pools, a.admitted)  # every lock left is an admitted request's own
    assert tree.protected_size() == 0
    tree.check_invariants(tails_t)
