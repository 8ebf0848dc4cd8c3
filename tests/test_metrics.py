"""Prometheus metrics: the text parses, every sgl_* metric SGLang or vLLM has also appears
under its sglang:* or vllm:* name with the same values, each Metrics keeps its own registry
(never prometheus_client's global one), and a real engine's requests show up in all, each
request's end observed once, streamed or not, finished or abandoned (a streamed one's first
token too)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

import sgl
from sgl.runtime.metrics import PEER_NAMES, SGLANG_NAMES, VLLM_NAMES, Metrics

INFO = {"max_total_tokens": 100, "kv_free": 50, "kv_evictable": 10, "running": 2, "waiting": 1,
        # a speculative engine's (sgl.sched.speculative): 4 request steps took 5 of 9 proposals
        "spec_steps": 4, "spec_proposed_tokens": 9, "spec_accepted_tokens": 5, "spec_accept_length": 2.25}
SGL_ONLY = {"sgl_scheduler_up", "sgl_transport_refused"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, for every sample but the _created timestamps."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def assert_mirrored(text: str, model_name: str) -> None:
    """Every sglang:* and vllm:* sample equals its sgl_* sample, labelled with the model name."""
    got = samples(text)
    fams = families(text)
    family = {s.name: f.name for f in text_string_to_metric_families(text) for s in f.samples}
    for names, prefix in zip(PEER_NAMES, ("sglang:", "vllm:")):
        for old, new in names.items():
            assert (old in fams) == (new in fams) and fams.get(old) == fams.get(new), (old, new)
        n = 0
        for (name, labels), value in got.items():
            old = family[name]
            if old not in names:
                continue
            twin = (names[old] + name[len(old):], tuple(sorted((*labels, ("model_name", model_name)))))
            assert got[twin] == value, (name, labels)
            n += 1
        assert n == sum(1 for name, _ in got if name.startswith(prefix)), f"a {prefix}* sample without its twin"


def feed(m: Metrics) -> None:
    m.first_token(0.03)
    m.inter_token(0.012, 3)
    m.finished(10, 5, 4, 0.5, "stop")
    m.finished(3, 1, 0, 0.1, "abort")


def test_both_name_families_carry_the_same_values() -> None:
    m = Metrics("smol")
    feed(m)
    text = m.render(INFO)
    assert_mirrored(text, "smol")
    got = samples(text)
    assert got[("sgl_prompt_tokens_total", ())] == 13 == got[("sglang:prompt_tokens_total", (("model_name", "smol"),))]
    assert got[("sgl_requests_total", ())] == 2 and got[("sgl_aborted_requests_total", ())] == 1
    assert got[("sgl_cache_hit_rate", ())] == pytest.approx(4 / 13)
    assert got[("sgl_token_usage", ())] == pytest.approx(0.4) and got[("sgl_kv_used_tokens", ())] == 40
    assert got[("sgl_inter_token_latency_seconds_count", ())] == 3
    assert got[("sgl_time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 1
    assert got[("sgl_time_to_first_token_seconds_bucket", (("le", "0.02"),))] == 0
    assert set(families(text)) >= SGL_ONLY | set(SGLANG_NAMES) | set(SGLANG_NAMES.values()) | set(VLLM_NAMES.values())
    vllm = (("model_name", "smol"),)
    assert got[("vllm:request_success_total", (("finished_reason", "abort"), *vllm))] == 1
    assert got[("vllm:request_success_total", (("finished_reason", "stop"), *vllm))] == 1
    assert got[("vllm:prefix_cache_queries_total", vllm)] == 13 and got[("vllm:prefix_cache_hits_total", vllm)] == 4
    assert got[("vllm:num_requests_running", vllm)] == 2 and got[("sglang:num_used_tokens", vllm)] == 40
    assert got[("sglang:spec_accept_length", vllm)] == 2.25 == got[("sgl_spec_accept_length", ())]
    assert got[("vllm:spec_decode_num_draft_tokens_total", vllm)] == 9
    assert got[("vllm:spec_decode_num_accepted_tokens_total", vllm)] == 5


def test_gen_throughput_counts_the_recent_window() -> None:
    m = Metrics()
    m.generated(30, 100.0)
    m.generated(20, 105.0)
    assert m.throughput(106.0) == pytest.approx(50 / 10)
    assert m.throughput(112.0) == pytest.approx(20 / 10)
    assert m.throughput(200.0) == 0.0


def test_render_without_scheduler_info_leaves_its_gauges_out() -> None:
    m = Metrics()
    feed(m)
    text = m.render(None, model_name="other")
    fams = families(text)
    assert samples(text)[("sgl_scheduler_up", ())] == 0
    for name in ("sgl_num_running_reqs", "sglang:num_running_reqs", "sgl_token_usage", "sglang:token_usage"):
        assert name not in fams
    assert_mirrored(text, "other")


def test_instances_do_not_share_state() -> None:
    a, b = Metrics("a"), Metrics("b")
    feed(a)
    assert a.registry is not b.registry
    got_b = samples(b.render(INFO))
    assert got_b[("sgl_prompt_tokens_total", ())] == 0 and got_b[("sgl_e2e_request_latency_seconds_count", ())] == 0
    assert got_b[("sglang:num_requests_total", (("model_name", "b"),))] == 0
    assert samples(a.render(INFO))[("sgl_requests_total", ())] == 2
    # Nothing went into prometheus_client's process-wide registry.
    global_names = {f.name for f in prometheus_client.REGISTRY.collect()}
    assert not {n for n in global_names if n.startswith(("sgl_", "sglang:"))}


@pytest.fixture(scope="module")
def engine(null_model_dir: str) -> Iterator[sgl.Engine]:
    e = sgl.Engine(null_model_dir, transport="inproc", load_format="null", skip_tokenizer_init=True,
                   max_total_tokens=400)
    yield e
    e.shutdown()


def test_an_engines_requests_show_in_both_families(engine: sgl.Engine) -> None:
    params: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 4}
    engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params=params)
    chunks = list(engine.generate(input_ids=[6, 7], sampling_params=params, stream=True))
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    text = engine._engine.metrics.render(engine.get_server_info(), "null-model")
    assert_mirrored(text, "null-model")
    got = samples(text)
    label = (("model_name", "null-model"),)
    assert got[("sgl_requests_total", ())] == 3 == got[("sglang:num_requests_total", label)]
    assert got[("sgl_prompt_tokens_total", ())] == 7 and got[("sgl_generation_tokens_total", ())] == 12
    # The streamed request's first token and every token after it (the others arrive whole).
    assert got[("sgl_time_to_first_token_seconds_count", ())] == 1 == got[("vllm:time_to_first_token_seconds_count",
                                                                            label)]
    assert got[("sgl_inter_token_latency_seconds_count", ())] == 3
    assert got[("sgl_e2e_request_latency_seconds_count", ())] == 3
    assert got[("sgl_scheduler_up", ())] == 1 and ("sglang:num_running_reqs", label) in got


def test_an_abandoned_request_is_observed_once_as_an_abort(engine: sgl.Engine) -> None:
    def counts() -> tuple[float, float, float]:
        got = samples(engine._engine.metrics.render(None))
        return (got[("sgl_requests_total", ())], got[("sgl_aborted_requests_total", ())],
                got[("sgl_e2e_request_latency_seconds_count", ())])

    before = counts()
    stream = engine.generate(input_ids=[8, 9], sampling_params={"max_new_tokens": 300, "ignore_eos": True},
                             stream=True)
    next(stream)
    stream.close()  # the caller goes away: the scheduler's abort finish comes back to nobody
    deadline = time.monotonic() + 10
    while counts() == before and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # a second observation (the scheduler's late abort) would land by now
    assert counts() == (before[0] + 1, before[1] + 1, before[2] + 1)


def test_transport_refusals_are_reported_by_kind() -> None:
    info = {**INFO, "transport_refused": 3, "transport_refused_auth": 2, "transport_refused_policy": 1}
    got = samples(Metrics().render(info))
    assert got[("sgl_transport_refused_total", (("kind", "auth"),))] == 2
    assert got[("sgl_transport_refused_total", (("kind", "policy"),))] == 1
    assert got[("sgl_transport_refused_total", (("kind", "replay"),))] == 0


def test_data_parallel_replicas_are_reported_by_dp_rank() -> None:
    replicas = [{**INFO, "routed": 5, "routed_by_prefix": 3},
                {**INFO, "kv_free": 100, "kv_evictable": 0, "running": 0, "waiting": 4, "routed": 2,
                 "routed_by_prefix": 0}]
    got = samples(Metrics().render({**INFO, "replicas": replicas}))
    assert got[("sgl_dp_num_running_reqs", (("dp_rank", "0"),))] == 2
    assert got[("sgl_dp_num_queue_reqs", (("dp_rank", "1"),))] == 4
    assert got[("sgl_dp_token_usage", (("dp_rank", "0"),))] == 0.4
    assert got[("sgl_dp_token_usage", (("dp_rank", "1"),))] == 0.0
    assert got[("sgl_dp_routed_requests_total", (("dp_rank", "0"),))] == 5
    assert got[("sgl_dp_routed_by_prefix_total", (("dp_rank", "1"),))] == 0
    assert not any(name.startswith("sgl_dp_") for name, _ in samples(Metrics().render(INFO)))
