"""Where one decode step's time goes, on a timeline: the scheduler's phases (host), the
grammar fill thread's two native calls and the GPU's forward and sampling, each placed
relative to the moment the previous step's results start being applied (the turn's t = 0),
averaged over the run's steady decode steps, for a JSON-schema run and the same batches
plain (each twice, in turn: the first runs pay what is left to compile): which chain from
one step's tokens to the next sampling sets the grammar step's time.

It drives the real Scheduler (overlap, CUDA graphs, its mask filler and fill thread) from
this process's main thread over the in-process channels, as benchmarks/profile_run does,
with the scheduler process's 0.2 ms switch interval; each phase is a wrapper that notes
perf_counter() around the scheduler's own function, and the GPU's are CUDA events around
the runner's forward and sampling, placed on the host clock through one event recorded
on an idle GPU. The wrappers cost a few us each: compare the two runs, not absolute times.

    python -m benchmarks.grammar_timeline --model .lt --config qwen3-0.6b [--requests 256] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import machine, with_architecture
from benchmarks.grammar_cost import SCHEMA
from sgl.core.protocol import GenerateReqInput
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.runtime.child import gpu_scheduler_process
from sgl.sched.models.default_model import default_model_dir
from sgl.sched.results import ResultProcessor
from sgl.sched.runner import grammar_masks
from sgl.sched.runner.model_runner import ModelRunner
from sgl.sched.runner.sampling_state import SamplingState
from sgl.sched.runner.step import Step
from sgl.sched.scheduler import Scheduler
from sgl.transports.inproc import InprocReceiver, InprocSender


class Timeline:
    """Host spans (name, start, end) and GPU spans (name, start event, end event)."""

    def __init__(self) -> None:
        self.host: list[tuple[str, float, float]] = []
        self.gpu: list[tuple[str, Any, Any]] = []
        self.on = False
        self.ref: tuple[float, Any] | None = None

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        orig = getattr(owner, attr)
        tl = self

        def timed(*args: Any, **kw: Any) -> Any:
            if not tl.on:
                return orig(*args, **kw)
            t = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                tl.host.append((name, t, time.perf_counter()))

        setattr(owner, attr, timed)

    def wrap_gpu(self, owner: Any, attr: str, name: str) -> None:
        orig = getattr(owner, attr)
        tl = self

        def timed(*args: Any, **kw: Any) -> Any:
            if not (tl.on and torch.cuda.is_available()):
                return orig(*args, **kw)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = orig(*args, **kw)
            b.record()
            tl.gpu.append((name, a, b))
            return out

        setattr(owner, attr, timed)

    def begin(self) -> None:
        self.host, self.gpu, self.on = [], [], True
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            ev.record()  # the GPU is idle: it passes this event at once
            self.ref = (t, ev)

    def end(self) -> list[tuple[str, float, float]]:
        """Every span on the host clock, in start order."""
        self.on = False
        spans = list(self.host)
        if self.ref is not None:
            torch.cuda.synchronize()
            t, ev = self.ref
            spans += [(n, t + ev.elapsed_time(a) / 1e3, t + ev.elapsed_time(b) / 1e3) for n, a, b in self.gpu]
        return sorted(spans, key=lambda s: s[1])


def install(tl: Timeline) -> None:
    tl.wrap(Scheduler, "_schedule", "build")
    tl.wrap(ModelRunner, "prepare", "prepare")
    tl.wrap(ModelRunner, "launch", "launch")
    tl.wrap(Step, "sample", "sample (grammar: queued)")
    tl.wrap(Step, "fill_masks", "masks started")
    tl.wrap(Step, "result", "gpu wait")
    tl.wrap(ResultProcessor, "apply", "process")
    tl.wrap(grammar_masks.MaskFiller, "finish", "mask wait")
    tl.wrap(grammar_masks, "accept_all", "fill thread: accepts")
    orig_filler = grammar_masks.MaskFiller._filler

    class Timed:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def batch_fill_next_token_bitmask(self, *a: Any, **kw: Any) -> None:
            t = time.perf_counter()
            self.inner.batch_fill_next_token_bitmask(*a, **kw)
            if tl.on:
                tl.host.append(("fill thread: fill", t, time.perf_counter()))

    grammar_masks.MaskFiller._filler = lambda self, rows: Timed(orig_filler(self, rows))  # type: ignore[method-assign]
    tl.wrap_gpu(ModelRunner, "_logits", "GPU: forward")
    tl.wrap_gpu(SamplingState, "sample", "GPU: sampling")


Spans = list[tuple[str, float, float]]


def turns(spans: Spans, skip: float) -> tuple[dict[str, list[tuple[float, float]]], list[float]]:
    """Each span's (start, end) relative to the turn it starts in: a turn begins when a
    step's tokens reach the host (their processing starts). Only the middle turns (`skip` of
    them cut at each end: prefill and the ragged tail)."""
    marks = [s for n, s, _ in spans if n == "process"]
    lo, hi = int(len(marks) * skip), int(len(marks) * (1 - skip))
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for n, s, e in spans:
        k = bisect.bisect_right(marks, s) - 1
        if lo <= k < hi - 1:
            out[n].append((s - marks[k], e - marks[k]))
    periods = [marks[k + 1] - marks[k] for k in range(lo, hi - 1)]
    return out, periods


def show(title: str, spans: list[tuple[str, float, float]], skip: float) -> None:
    by, periods = turns(spans, skip)
    n = len(periods)
    print(f"\n{title}: {n} turns, period {sum(periods) / n * 1e3:.3f} ms (median "
          f"{sorted(periods)[n // 2] * 1e3:.3f}); t = 0 where a step's tokens reach the host")
    print(f"{'phase':<24} {'per turn':>8} {'starts ms':>10} {'ends ms':>8} {'lasts ms':>9}")
    rows = []
    for name, v in by.items():
        start = sum(s for s, _ in v) / len(v)
        end = sum(e for _, e in v) / len(v)
        rows.append((start, name, len(v) / n, end))
    for start, name, per, end in sorted(rows):
        print(f"{name:<24} {per:8.2f} {start * 1e3:10.3f} {end * 1e3:8.3f} {(end - start) * 1e3:9.3f}")


def drive(s: Scheduler, feed: InprocSender, out: InprocReceiver, reqs: list[GenerateReqInput]) -> list[int]:
    """Submit, step until idle; the output lengths (from the token-id batches sent)."""
    for r in reqs:
        feed.send(r)
    got: dict[str, int] = {}
    s.step()
    while not s.idle or s.grammars.pending:
        s.step()
        for msg in out.recv_all_nowait():
            for rid, why, n in zip(getattr(msg, "rids", ()), getattr(msg, "finished_reasons", ()),
                                   getattr(msg, "completion_tokens", ())):
                if why is not None:
                    got[rid] = n
    return [got.get(r.rid, 0) for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--config", default="qwen3-0.6b", help="benchmarks/configs architecture (dummy weights)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--skip", type=float, default=0.2, help="share of turns cut at each end")
    a = ap.parse_args()
    gpu_scheduler_process()  # the settings of a served engine's scheduler process
    model = with_architecture(a.model or default_model_dir(), a.config)
    tl = Timeline()
    install(tl)
    args = ServerArgs.from_kwargs(model_path=model, load_format="dummy", dtype="bfloat16", random_seed=0)
    s = Scheduler(args, model, InprocReceiver("timeline-in"), InprocSender("timeline-out"))
    feed, out = InprocSender("timeline-in"), InprocReceiver("timeline-out")
    print(machine(), flush=True)
    schema = json.dumps(SCHEMA)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(f"Describe river number {i} as JSON:") for i in range(a.requests)]

    def reqs(tag: str, params: Callable[[int], SamplingParams]) -> list[GenerateReqInput]:
        return [GenerateReqInput(f"{tag}{i}", p, params(i)) for i, p in enumerate(prompts)]

    t = time.perf_counter()
    drive(s, feed, out, reqs("warm", lambda i: SamplingParams(max_new_tokens=8, json_schema=schema,
                                                              temperature=a.temperature))[:4])
    print(f"warm-up (the schema's compile) {time.perf_counter() - t:.1f} s", flush=True)
    runs: list[tuple[str, float, Spans]] = []
    lens: list[int] = []  # the JSON run's output lengths, which the plain run asks for

    def plain_params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max(1, lens[i]), ignore_eos=True, temperature=a.temperature)

    for k in range(2):  # json, plain, json, plain: the first pair pays what is left to compile
        for kind in ("json", "plain"):
            s.kv.flush()
            tl.begin()
            t = time.perf_counter()
            if kind == "json":
                got = drive(s, feed, out, reqs(f"json{k}-", lambda i: SamplingParams(
                    max_new_tokens=a.new_tokens, json_schema=schema, temperature=a.temperature)))
                lens[:] = lens or got
            else:
                drive(s, feed, out, reqs(f"plain{k}-", plain_params))
            runs.append((f"{kind} (run {k + 1})", time.perf_counter() - t, tl.end()))
    plain = runs[-1][1]
    for name, secs, _ in runs:
        print(f"{name:<24} {secs:6.3f} s, plain / this {plain / secs:.3f} ({sum(lens)} tokens)")
    for name, _, spans in runs[2:]:
        show(name, spans, a.skip)
    s.close()


if __name__ == "__main__":
    main()
