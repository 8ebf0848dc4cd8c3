"""Data parallelism: the router over scheduler replicas (sgl/runtime/dp_router.py) as a
unit, with properties of its bookkeeping, and an engine of two replicas end to end
(null weights: exact outputs), where both replicas serve and every request that
shares a routed prefix finds it in its replica's radix cache."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

import sgl
from sgl.core.protocol import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReqOutput,
    HealthCheckOutput,
)
from sgl.core.sampling_params import SamplingParams
from sgl.runtime.dp_router import BALANCE_SLACK, BLOCK, DataParallelSender, merge_replies
from tests.conftest import assert_kv_balanced, null_continuation
from tests.fake_channels import ListSender


def _req(rid: str, ids: list[int], leader: str | None = None) -> GenerateReqInput:
    return GenerateReqInput(rid, ids, SamplingParams(), prefix_leader=leader)


def _router(n: int) -> tuple[DataParallelSender, list[ListSender]]:
    outs = [ListSender() for _ in range(n)]
    return DataParallelSender(list(outs)), outs


def test_prefix_affinity_then_load() -> None:
    r, outs = _router(2)
    a, b = [1] * BLOCK * 2, [2] * BLOCK * 2
    r.send(_req("a0", a + [5]))
    r.send(_req("b0", b + [5]))  # no routed prefix: the least busy replica
    r.send(_req("a1", a + [6]))
    r.send(_req("b1", b + [6]))
    r.send(_req("s", [3, 4]))  # shorter than a block: by load alone
    assert [m.rid for m in outs[0].msgs] == ["a0", "a1", "s"]  # s: loads tie, the first replica
    assert [m.rid for m in outs[1].msgs] == ["b0", "b1"]
    assert r.affine == [1, 1]
    r.send(AbortReq("b1"))
    assert outs[1].msgs[-1] == AbortReq("b1") and AbortReq("b1") not in outs[0].msgs
    r.send(FlushCacheReq())
    assert all(isinstance(o.msgs[-1], FlushCacheReq) for o in outs)


def test_samples_follow_their_leader_and_overload_breaks_affinity() -> None:
    r, outs = _router(2)
    p = [7] * BLOCK
    for i in range(20):  # on replica 0 until it is far busier than the idle replica 1
        r.send(_req(f"r{i}", p + [i]))
    slack = BALANCE_SLACK + 1
    assert [m.rid for m in outs[0].msgs] == [f"r{i}" for i in range(slack)]
    assert [m.rid for m in outs[1].msgs][0] == f"r{slack}"  # and the prefix now lives there
    r.send(_req("lead", [9] * BLOCK))
    k = r.routed["lead"]
    r.send(_req("lead-1", [9] * BLOCK, leader="lead"))
    assert r.routed["lead-1"] == k


@given(st.lists(st.tuples(st.sampled_from(["send", "finish", "abort"]), st.integers(0, 30),
                          st.integers(0, 3)), max_size=80))
def test_loads_count_exactly_the_requests_in_flight(ops: list[tuple[str, int, int]]) -> None:
    r, outs = _router(3)
    live: set[str] = set()
    sends = 0
    for op, i, prefix in ops:
        rid = f"q{i}"
        if op == "send" and rid not in live:  # a finished rid may be sent again
            r.send(_req(rid, [prefix] * BLOCK + [i]))
            live.add(rid)
            sends += 1
        elif op == "finish":
            r.finished(rid)
            live.discard(rid)
        elif op == "abort" and rid in live:
            k = r.routed[rid]
            r.send(AbortReq(rid))
            assert outs[k].msgs[-1] == AbortReq(rid)
    assert sum(r.load) == len(live) and min(r.load) >= 0
    assert set(r.routed) == live
    sent = [m.rid for o in outs for m in o.msgs if isinstance(m, GenerateReqInput)]
    assert len(sent) == sends  # each send went to exactly one replica


def test_merged_replies() -> None:
    infos = [{"kv_free": 10, "max_total_tokens": 12, "vocab_size": 512, "running": 1},
             {"kv_free": 5, "max_total_tokens": 12, "vocab_size": 512, "running": 1}]
    m = merge_replies([GetServerInfoReqOutput(i, req_id=3) for i in infos])
    assert isinstance(m, GetServerInfoReqOutput) and m.req_id == 3
    assert m.info["kv_free"] == 15 and m.info["max_total_tokens"] == 24 and m.info["running"] == 2
    assert m.info["vocab_size"] == 512 and m.info["replicas"] == infos
    flush = merge_replies([FlushCacheReqOutput(True), FlushCacheReqOutput(False)])
    assert isinstance(flush, FlushCacheReqOutput) and not flush.success
    health = merge_replies([HealthCheckOutput(True), HealthCheckOutput(True)])
    assert isinstance(health, HealthCheckOutput) and health.ok


def test_two_replicas_serve_with_prefix_affinity(null_model_dir: str) -> None:
    groups = [[[g] * (2 * BLOCK) + [i, 2, 3] for i in range(4)] for g in (1, 9)]
    prompts = groups[0] + groups[1]
    sp: dict[str, Any] = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    with sgl.Engine(null_model_dir, load_format="null", dp_size=2, skip_tokenizer_init=True, device="cpu",
                    transport="inproc") as e:
        first = e.generate(input_ids=prompts, sampling_params=sp)
        again = e.generate(input_ids=prompts, sampling_params=sp)
        info = e.get_server_info()
    for p, o in zip(prompts * 2, first + again):
        assert o["output_ids"] == null_continuation(p[-1], 5)
    assert all(o["meta_info"]["cached_tokens"] >= 2 * BLOCK for o in again)  # each found its prefix
    assert [r["routed"] for r in info["replicas"]] == [8, 8]  # both served; a prefix group stays on one
    assert all(r["cached_tokens"] > 0 for r in info["replicas"])
    assert_kv_balanced(info)
    for r in info["replicas"]:
        assert_kv_balanced(r)
