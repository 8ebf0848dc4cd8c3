"""Request metrics of one server and their Prometheus text rendering.

The tokenizer manager feeds it (time to first token, inter-token latency,
end-to-end latency, token counts) as outputs arrive; gauges that belong to the
scheduler (running, queued, KV usage) are read from its server info when
/metrics is scraped. It imports nothing of sgl and never blocks."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        acc = 0
        for bound, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f'{name}_bucket{{le="{bound}"}} {acc}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.n}")
        return lines


class Metrics:
    """What the tokenizer manager observes. Single-threaded: called on its loop only."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.requests = 0
        self.aborted = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, n_tokens: int) -> None:
        for _ in range(n_tokens):
            self.itl.observe(seconds / n_tokens)

    def finished(self, prompt: int, completion: int, cached: int, e2e: float, aborted: bool) -> None:
        self.requests += 1
        self.aborted += aborted
        self.prompt_tokens += prompt
        self.generation_tokens += completion
        self.cached_tokens += cached
        self.e2e.observe(e2e)

    def render(self, info: dict[str, Any] | None) -> str:
        """Prometheus text format; `info` is the scheduler's server info (None: unreachable)."""
        out: list[str] = []

        def scalar(name: str, kind: str, help_text: str, value: float) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"])

        scalar("sgl_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        scalar("sgl_generation_tokens_total", "counter", "Generated tokens of finished requests.", self.generation_tokens)
        scalar("sgl_cached_tokens_total", "counter", "Prompt tokens served from the radix cache.", self.cached_tokens)
        scalar("sgl_requests_total", "counter", "Finished requests.", self.requests)
        scalar("sgl_aborted_requests_total", "counter", "Requests that ended with an abort.", self.aborted)
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        scalar("sgl_cache_hit_rate", "gauge", "Cached share of all prompt tokens so far.", hit)
        scalar("sgl_scheduler_up", "gauge", "1 while the scheduler answers.", 0 if info is None else 1)
        if info is not None:
            total = info["max_total_tokens"]
            used = total - info["kv_free"] - info["kv_evictable"]
            scalar("sgl_num_running_reqs", "gauge", "Requests in the running batch.", info["running"])
            scalar("sgl_num_queue_reqs", "gauge", "Requests waiting to be scheduled.", info["waiting"])
            scalar("sgl_token_usage", "gauge", "Share of KV slots held by requests.", used / total if total else 0.0)
            scalar("sgl_kv_used_tokens", "gauge", "KV slots held by requests.", used)
            scalar("sgl_kv_total_tokens", "gauge", "KV slots in the pool.", total)
        out += self.ttft.render("sgl_time_to_first_token_seconds", "Time to first token (streaming requests).")
        out += self.itl.render("sgl_inter_token_latency_seconds", "Time between tokens (streaming requests).")
        out += self.e2e.render("sgl_e2e_request_latency_seconds", "End-to-end request latency.")
        return "\n".join(out) + "\n"
