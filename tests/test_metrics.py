"""Prometheus metrics: the text parses, every sgl_* metric SGLang has also appears under
its sglang:* name with the same values, each Metrics keeps its own registry (never
prometheus_client's global one), and a real engine's requests show up in both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

import sgl
from sgl.runtime.metrics import SGLANG_NAMES, Metrics

INFO = {"max_total_tokens": 100, "kv_free": 50, "kv_evictable": 10, "running": 2, "waiting": 1}
SGL_ONLY = {"sgl_aborted_requests", "sgl_scheduler_up", "sgl_kv_used_tokens", "sgl_kv_total_tokens",
            "sgl_transport_refused"}


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
    """Every sglang:* sample equals its sgl_* sample, labelled with the model name."""
    got = samples(text)
    fams = families(text)
    for old, new in SGLANG_NAMES.items():
        assert (old in fams) == (new in fams) and fams.get(old) == fams.get(new), (old, new)
    n = 0
    for (name, labels), value in got.items():
        old = next((o for o in SGLANG_NAMES if name.startswith(o)), None)
        if old is None or name.startswith("sglang:"):
            continue
        twin = (SGLANG_NAMES[old] + name[len(old):], tuple(sorted((*labels, ("model_name", model_name)))))
        assert got[twin] == value, (name, labels)
        n += 1
    assert n == sum(1 for name, _ in got if name.startswith("sglang:")), "an sglang:* sample without its twin"


def feed(m: Metrics) -> None:
    m.first_token(0.03)
    m.inter_token(0.012, 3)
    m.finished(10, 5, 4, 0.5, False)
    m.finished(3, 1, 0, 0.1, True)


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
    assert set(families(text)) >= SGL_ONLY | set(SGLANG_NAMES) | set(SGLANG_NAMES.values())


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
    assert got[("sgl_time_to_first_token_seconds_count", ())] == 1  # the streamed request only
    assert got[("sgl_inter_token_latency_seconds_count", ())] == 3
    assert got[("sgl_scheduler_up", ())] == 1 and ("sglang:num_running_reqs", label) in got


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
