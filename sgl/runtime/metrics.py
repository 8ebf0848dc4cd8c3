"""Request metrics of one server, kept with prometheus_client, and their Prometheus text.

The tokenizer manager feeds it (time to first token, inter-token latency,
end-to-end latency, token counts, how each request ended) as outputs arrive:
every request's end once, aborted ones included, and the first token of every
request that made one, streamed or not. Gauges that belong to the scheduler
(running, queued, KV usage) are read from its server info when /metrics is
scraped and are never stored. Every metric has its sgl_* name and, for the ones
SGLang or vLLM has, their sglang:* and vllm:* names too (with their model_name
label), so their dashboards work unchanged; all carry the same values.

Each Metrics owns its CollectorRegistry: it must never register anything in
prometheus_client's global default registry (two engines in one process would
collide, and a library must not add globals). It imports nothing of sgl and
never blocks.

prometheus_client is imported when the first Metrics is made, not with this module:
it brings an HTTP server and the email package (tens of ms), which the engine's
import, often the first thing a caller's loop runs, need not pay for."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from sgl.transports.refusals import KINDS, TOTAL

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)

THROUGHPUT_WINDOW_S = 10.0  # gen_throughput: generated tokens per second over the last this many seconds

# sgl_* family -> SGLang's family of the same meaning (sample names follow: *_total, *_bucket, ...).
SGLANG_NAMES = {
    "sgl_prompt_tokens": "sglang:prompt_tokens",
    "sgl_generation_tokens": "sglang:generation_tokens",
    "sgl_cached_tokens": "sglang:cached_tokens",
    "sgl_requests": "sglang:num_requests",
    "sgl_aborted_requests": "sglang:num_aborted_requests",
    "sgl_cache_hit_rate": "sglang:cache_hit_rate",
    "sgl_gen_throughput": "sglang:gen_throughput",
    "sgl_num_running_reqs": "sglang:num_running_reqs",
    "sgl_num_queue_reqs": "sglang:num_queue_reqs",
    "sgl_token_usage": "sglang:token_usage",
    "sgl_kv_used_tokens": "sglang:num_used_tokens",
    "sgl_kv_total_tokens": "sglang:max_total_num_tokens",
    "sgl_time_to_first_token_seconds": "sglang:time_to_first_token_seconds",
    "sgl_inter_token_latency_seconds": "sglang:inter_token_latency_seconds",
    "sgl_e2e_request_latency_seconds": "sglang:e2e_request_latency_seconds",
    "sgl_spec_accept_length": "sglang:spec_accept_length",
}
# ... and vLLM's (its V1 engine's names).
VLLM_NAMES = {
    "sgl_prompt_tokens": "vllm:prompt_tokens",
    "sgl_generation_tokens": "vllm:generation_tokens",
    "sgl_prompt_tokens_queried": "vllm:prefix_cache_queries",
    "sgl_cached_tokens": "vllm:prefix_cache_hits",
    "sgl_finished_requests": "vllm:request_success",
    "sgl_num_running_reqs": "vllm:num_requests_running",
    "sgl_num_queue_reqs": "vllm:num_requests_waiting",
    "sgl_token_usage": "vllm:kv_cache_usage_perc",
    "sgl_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "sgl_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "sgl_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "sgl_spec_steps": "vllm:spec_decode_num_drafts",
    "sgl_spec_proposed_tokens": "vllm:spec_decode_num_draft_tokens",
    "sgl_spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
PEER_NAMES = (SGLANG_NAMES, VLLM_NAMES)
FINISH_REASONS = ("stop", "length", "abort")


class Metrics:
    """What the tokenizer manager observes. Called on its loop; prometheus_client's
    metrics are thread-safe, so a scrape from another thread is fine too.

    `registry` holds the observed metrics (sgl_* names); `render` adds the scheduler's
    gauges and the sglang:* and vllm:* names at scrape time. `model_name` is the label
    value of those series unless render is given one."""

    def __init__(self, model_name: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("sgl_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("sgl_generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.cached_tokens = Counter("sgl_cached_tokens", "Prompt tokens served from the radix cache.", registry=r)
        self.requests = Counter("sgl_requests", "Finished requests.", registry=r)
        self.aborted = Counter("sgl_aborted_requests", "Requests that ended with an abort.", registry=r)
        self.by_reason = Counter("sgl_finished_requests", "Finished requests by how they ended.",
                                 ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.by_reason.labels(reason)
        # Equal to sgl_prompt_tokens: vLLM counts the prompt tokens looked up in its prefix cache apart.
        self.queried = Counter("sgl_prompt_tokens_queried", "Prompt tokens looked up in the radix cache.",
                               registry=r)
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) generated in the throughput window
        Gauge("sgl_gen_throughput", "Generated tokens per second, over the last "
              f"{THROUGHPUT_WINDOW_S:g} s.", registry=r).set_function(self.throughput)
        self._prompt = 0  # the hit rate's terms, without reading the counters' private values
        self._cached = 0
        Gauge("sgl_cache_hit_rate", "Cached share of all prompt tokens so far.", registry=r).set_function(
            lambda: self._cached / self._prompt if self._prompt else 0.0)
        self.ttft = Histogram("sgl_time_to_first_token_seconds", "Time to first token, of each request that made "
                              "one.", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sgl_inter_token_latency_seconds", "Time between tokens (a request not streamed: "
                             "their mean after the first).", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sgl_e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=E2E_BUCKETS, registry=r)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, n_tokens: int) -> None:
        for _ in range(n_tokens):
            self.itl.observe(seconds / n_tokens)

    def generated(self, n_tokens: int, now: float) -> None:
        self._recent.append((now, n_tokens))
        self._trim(now)

    def throughput(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def finished(self, prompt: int, completion: int, cached: int, e2e: float, reason: str) -> None:
        """A request's end (`reason`: its finish type, stop, length or abort): called once per request."""
        self.requests.inc()
        if reason == "abort":
            self.aborted.inc()
        self.by_reason.labels(reason if reason in FINISH_REASONS else "abort").inc()
        self.queried.inc(prompt)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        self._prompt += prompt
        self._cached += cached
        self.e2e.observe(e2e)

    def render(self, info: dict[str, Any] | None, model_name: str | None = None) -> str:
        """Prometheus text format; `info` is the scheduler's server info (None: unreachable,
        and then its gauges are left out but sgl_scheduler_up, which reads 0)."""
        from prometheus_client import generate_latest

        label = self.model_name if model_name is None else model_name
        return generate_latest(_Scrape(self.registry, info, label)).decode()


class _Scrape:
    """One scrape: the registry's families, the scheduler's gauges from `info`, then all
    of those that SGLang or vLLM has under their names, labelled with the model name.
    Read once by generate_latest; holds nothing afterwards."""

    def __init__(self, registry: CollectorRegistry, info: dict[str, Any] | None, model_name: str) -> None:
        self.registry = registry
        self.info = info
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        families = [*self.registry.collect(), *_scheduler_families(self.info)]
        yield from families
        for names in PEER_NAMES:
            yield from _renamed(families, names, self.model_name)


def _scheduler_families(info: dict[str, Any] | None) -> Iterator[Metric]:
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("sgl_scheduler_up", "1 while the scheduler answers.", 0 if info is None else 1)
    if info is None:
        return
    yield GaugeMetricFamily("sgl_num_running_reqs", "Requests prefilling or decoding.", info["running"])
    yield GaugeMetricFamily("sgl_num_queue_reqs", "Requests waiting to be scheduled.", info["waiting"])
    yield GaugeMetricFamily("sgl_token_usage", "Share of KV slots held by requests.", _token_usage(info))
    yield GaugeMetricFamily("sgl_kv_used_tokens", "KV slots held by requests.", _kv_used(info))
    yield GaugeMetricFamily("sgl_kv_total_tokens", "KV slots in the pool.", info["max_total_tokens"])
    if info.get("spec_steps") is not None:  # a speculative engine
        yield GaugeMetricFamily("sgl_spec_accept_length", "Tokens a request gains per speculative step, on average.",
                                info["spec_accept_length"] or 0.0)
        yield CounterMetricFamily("sgl_spec_steps", "Requests' steps with proposals.", info["spec_steps"])
        yield CounterMetricFamily("sgl_spec_proposed_tokens", "Tokens proposed to speculative steps.",
                                  info["spec_proposed_tokens"])
        yield CounterMetricFamily("sgl_spec_accepted_tokens", "Proposed tokens the speculative steps accepted.",
                                  info["spec_accepted_tokens"])
    refused = CounterMetricFamily("sgl_transport_refused", "Frames or messages the scheduler's receiver refused.",
                                  labels=["kind"])
    for kind in KINDS:
        refused.add_metric([kind], info.get(f"{TOTAL}_{kind}", 0))
    yield refused
    yield from _replica_families(info.get("replicas") or [])


def _kv_used(info: dict[str, Any]) -> int:
    """A scheduler's KV slots held by requests: neither free nor evictable."""
    return info["max_total_tokens"] - info["kv_free"] - info["kv_evictable"]


def _token_usage(info: dict[str, Any]) -> float:
    total = info["max_total_tokens"]
    return _kv_used(info) / total if total else 0.0


def _replica_families(replicas: list[dict[str, Any]]) -> Iterator[Metric]:
    """Behind data parallelism, each replica's gauges and routing counts, by dp_rank."""
    if not replicas:
        return
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

    fams: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily("sgl_dp_num_running_reqs", "Requests running in a replica.", labels=["dp_rank"]),
            GaugeMetricFamily("sgl_dp_num_queue_reqs", "Requests waiting in a replica.", labels=["dp_rank"]),
            GaugeMetricFamily("sgl_dp_token_usage", "Share of a replica's KV slots held.", labels=["dp_rank"]),
            CounterMetricFamily("sgl_dp_routed_requests", "Requests routed to a replica.", labels=["dp_rank"]),
            CounterMetricFamily("sgl_dp_routed_by_prefix", "Of them, routed by prefix affinity.", labels=["dp_rank"])]
    for k, r in enumerate(replicas):
        for fam, value in zip(fams, (r["running"], r["waiting"], _token_usage(r), r.get("routed", 0),
                                     r.get("routed_by_prefix", 0))):
            fam.add_metric([str(k)], value)
    yield from fams


def _renamed(families: Iterable[Metric], names: dict[str, str], model_name: str) -> Iterator[Metric]:
    """Copies of the families a peer has, renamed to its `names`, every sample labelled
    model_name: same values by construction."""
    from prometheus_client.metrics_core import Metric

    for fam in families:
        new = names.get(fam.name)
        if new is None:
            continue
        out = Metric(new, fam.documentation, fam.type, fam.unit)
        for s in fam.samples:
            out.add_sample(new + s.name[len(fam.name):], {**s.labels, "model_name": model_name}, s.value,
                           s.timestamp, s.exemplar)
        yield out
