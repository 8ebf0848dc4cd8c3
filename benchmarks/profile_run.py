"""Where a whole workload's GPU time goes: one timed run of W1, W2 or W3 through the
real scheduler (its own `step()` loop, overlap and CUDA graphs as configured), driven
from this process's main thread over in-process channels with no other role, so that
torch.profiler sees every kernel it queues, CUDA-graph replays included. (An inproc
engine is not used: on a fresh H200 its start took 141 s, 126 s of it capturing CUDA
graphs, against 2-5 s in the engine's child process; the cause was not found.)
Prints:

- the kernels by total GPU time (top N) and by kind (decode attention, prefill
  attention, GEMMs, norms, rotary, activation, sampling, KV writes, copies, other);
- the batches by kind and size: count, GPU ms per batch (CUDA events around each
  step, as the scheduler's own timeline records them) and the GPU's wait for the
  host before each one, so the shrinking tail of W2 shows apart from its full start.

The profiler costs host time (it records each launch), so this run's wall time is
not the benchmark's: use w1_w2_gpu / w3_shared_prefix for throughput.

    python -m benchmarks.profile_run --workload W2 [--top 40] [--no-trace] [--config qwen3-8b]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks.common import dummy_model_dir, machine, table
from benchmarks.kernel_kinds import kind_rows, result_fields, top_rows
from benchmarks.w1_w2_gpu import workload
from benchmarks.w3_shared_prefix import w3_prompts
from sgl.core.protocol import GenerateReqInput
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.runtime.child import gpu_scheduler_process
from sgl.sched.runner import step as step_mod
from sgl.sched.scheduler import Scheduler
from sgl.transports.inproc import InprocReceiver, InprocSender


def run(s: Scheduler, feed: InprocSender, out: InprocReceiver, prompts: list[list[int]], outs: list[int],
        temp: float, tag: str) -> float:
    """Submit every request, step the scheduler until it is idle (reading what it sends,
    as the detokenizer would); the wall time."""
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs)):
        feed.send(GenerateReqInput(f"{tag}{i}", p, SamplingParams(max_new_tokens=o, temperature=temp, ignore_eos=True)))
    s.step()
    while not s.idle:
        s.step()
        out.recv_all_nowait()
    return time.perf_counter() - t0


class StepLog:
    """Every collected step: (decode?, batch rows, GPU ms, GPU wait before it in ms)."""

    def __init__(self) -> None:
        self.rows: list[tuple[bool, int, float, float]] = []
        self.on = False
        self._prev: torch.cuda.Event | None = None

    def install(self) -> None:
        orig = step_mod.Step.result
        log = self

        def result(h: Any) -> Any:
            out = orig(h)
            if log.on:
                gap = max(0.0, log._prev.elapsed_time(h.start)) if log._prev is not None else 0.0
                log.rows.append((h.prepared.attn.is_decode, int(out.next_ids.numel()), h.start.elapsed_time(h.done),
                                 gap))
            log._prev = h.done
            return out

        step_mod.Step.result = result  # type: ignore[method-assign]


def buckets(rows: list[tuple[bool, int, float, float]]) -> list[dict[str, object]]:
    edges = [1, 16, 32, 64, 128, 192, 256, 512, 1 << 30]
    groups: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for decode, b, ms, gap in rows:
        hi = next(e for e in edges if b <= e)
        groups[("decode" if decode else "prefill", hi)].append((ms, gap))
    out = []
    for (kind, hi), v in sorted(groups.items()):
        lo = edges[edges.index(hi) - 1] + 1 if edges.index(hi) else 1
        out.append({"batch": kind, "rows": f"{lo}-{hi}" if hi < 1 << 30 else f">{lo - 1}", "count": len(v),
                    "GPU ms each": sum(x for x, _ in v) / len(v), "GPU s": sum(x for x, _ in v) / 1000,
                    "wait ms each": sum(g for _, g in v) / len(v), "wait s": sum(g for _, g in v) / 1000})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="W2", choices=["W1", "W2", "W3"])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-trace", action="store_true", help="only the per-batch table (no torch.profiler)")
    a = ap.parse_args()
    gpu_scheduler_process()  # the settings of a served engine's scheduler process
    if a.workload == "W3":
        prompts = w3_prompts(a.requests)
        outs, temp = [128] * a.requests, 0.0
    else:
        prompts, outs, temp = workload(a.workload, a.requests)
    log = StepLog()
    log.install()
    t0 = time.perf_counter()
    model = dummy_model_dir(a.config)
    args = ServerArgs.from_kwargs(model_path=model, load_format="dummy", skip_tokenizer_init=True, random_seed=0)
    # The real in-process channels (the codec included), not the engine's threads.
    s = Scheduler(args, model, InprocReceiver("profile-run-in"), InprocSender("profile-run-out"))
    feed, out = InprocSender("profile-run-in"), InprocReceiver("profile-run-out")
    print(f"ready in {time.perf_counter() - t0:.1f} s {s.runner.startup}", flush=True)
    run(s, feed, out, prompts[:8], outs[:8], temp, "warm")
    s.kv.flush()
    log.on = True
    prof = None
    if not a.no_trace:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    wall = run(s, feed, out, prompts, outs, temp, "r")
    if prof is not None:
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
    log.on = False
    print(f"scheduler loop: { {k: round(float(v), 3) for k, v in s.stats.items()} }")
    s.close()
    print(f"{a.workload} on {machine()} ({a.config}), profiled wall {wall:.2f} s "
          f"({sum(outs) / wall:,.0f} tok/s under the profiler)")
    if log.rows:  # none on CPU: its steps are not CUDA events
        print(table(buckets(log.rows)))
    gpu = sum(ms for _, _, ms, _ in log.rows) / 1000
    wait = sum(g for _, _, _, g in log.rows) / 1000
    print(f"steps {len(log.rows)}: GPU busy {gpu:.3f} s, GPU waiting for the host {wait:.3f} s")
    if prof is None:
        return
    kernels: dict[str, tuple[float, int]] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if t > 0:
            s, c = kernels.get(ev.key, (0.0, 0))
            kernels[ev.key] = (s + t / 1e6, c + ev.count)
    print(table(kind_rows(kernels)))
    print(table(top_rows(kernels, a.top)))
    print(f"RESULT name=profile_{a.workload} step_gpu_s={gpu:.3f} wait_s={wait:.3f} {result_fields(kernels)}")


if __name__ == "__main__":
    main()
