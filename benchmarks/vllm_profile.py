"""vLLM's side of W7's profile: one run of W2 (or W1) through the vLLM peer under the torch
profiler, its GPU time by kernel kind beside sgl's (benchmarks/profile_run.py; the kinds of
benchmarks/kernel_kinds.py). The inputs, model folder and engine settings are those of the
peer's own bench.py, loaded from its kit (`--kit`), so the profiled run is the one `vllm8b`
times; the profiler slows it, so its wall time is not the benchmark's.

It runs where the vLLM peer is importable (benchmarks/gpu/run.sh `vllmprof8b`, inside
vllm_env). vLLM's workers write their traces (Chrome trace JSON, gzipped) into `--out`;
the kernels are read back from them: every GPU kernel, copy and memset, by name.

    python -m benchmarks.vllm_profile --kit .peer/vllm/kit [--config benchmarks/configs/qwen3-8b.json]
        [--workload W2] [--requests 256] [--out DIR] [--top 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.common import table
from benchmarks.kernel_kinds import kind_rows, result_fields, top_rows

GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace categories of GPU work
TRACE_WAIT_S = 300.0  # how long the workers may take to write their traces after stop_profile


def load_kit(kit: str) -> ModuleType:
    """The peer's bench.py as a module (its inputs, model folder and engine environment)."""
    path = Path(kit) / "bench.py"
    spec = importlib.util.spec_from_file_location("vllm_peer_bench", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no bench.py in {kit}: pass --kit, the vLLM peer's kit folder")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def trace_kernels(paths: list[Path]) -> dict[str, tuple[float, int]]:
    """name -> (GPU seconds, calls) of the GPU events in these Chrome traces (gzipped or not)."""
    out: dict[str, tuple[float, int]] = {}
    for p in paths:
        opener: Any = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for ev in events:
            if ev.get("cat") in GPU_EVENTS and ev.get("ph") == "X":
                s, c = out.get(ev["name"], (0.0, 0))
                out[ev["name"]] = (s + float(ev.get("dur", 0.0)) / 1e6, c + 1)
    return out


def written_traces(folder: Path, timeout: float = TRACE_WAIT_S, poll: float = 2.0) -> list[Path]:
    """The trace files in `folder` once their sizes hold for `poll` seconds (the workers
    may write them after stop_profile returns); [] if none came within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: dict[Path, int] = {}
    while time.monotonic() < deadline:
        now = {p: p.stat().st_size for p in folder.rglob("*trace.json*")}
        if now and now == last:
            return sorted(now)
        last = now
        time.sleep(poll)
    return sorted(last)


def start_profiled(llm_cls: Any, kw: dict[str, Any], folder: Path) -> Any:
    """The engine with its workers' torch profiler on: through a ProfilerConfig where this
    vLLM has one (GPU kernels only, no stacks or shapes), else the older environment
    variable, which must be set before the engine starts."""
    try:
        from vllm.config import ProfilerConfig
    except ImportError:
        ProfilerConfig = None
    if ProfilerConfig is not None:
        wanted = {"profiler": "torch", "torch_profiler_dir": str(folder), "torch_profiler_with_stack": False,
                  "torch_profiler_record_shapes": False, "torch_profiler_dump_cuda_time_total": False,
                  "ignore_frontend": True}
        try:
            names = {f.name for f in dataclasses.fields(ProfilerConfig)}
        except TypeError:  # a pydantic model rather than a dataclass
            names = set(getattr(ProfilerConfig, "model_fields", wanted))
        config = ProfilerConfig(**{k: v for k, v in wanted.items() if k in names})
        try:
            return llm_cls(**kw, profiler_config=config)
        except TypeError as e:  # an engine without the argument: refused before it loads anything
            if "profiler_config" not in str(e):
                raise
    os.environ["VLLM_TORCH_PROFILER_DIR"] = str(folder)
    return llm_cls(**kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kit", default=".peer/vllm/kit", help="the vLLM peer's kit folder (its bench.py)")
    ap.add_argument("--config", default=None, help="a Hugging Face config.json (default: the kit's Qwen3-0.6B)")
    ap.add_argument("--workload", default="W2", choices=["W1", "W2"])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--out", default="vllm-profile", help="the folder the traces are written to")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    kit = load_kit(a.kit)
    for k, v in kit.ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    folder = Path(a.out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    cfg, label = kit.load_config(a.config)
    prompts, outs, temp = kit.build(a.workload, a.requests)

    import vllm
    from vllm import LLM, SamplingParams

    # The engine bench.py's child starts (its defaults), with the profiler on.
    kw: dict[str, Any] = dict(model=kit.model_dir(cfg), load_format="dummy", skip_tokenizer_init=True,
                              dtype="bfloat16", gpu_memory_utilization=0.85, max_num_seqs=256, seed=0)
    llm = start_profiled(LLM, kw, folder)
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=temp, detokenize=False) for o in outs]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    n = kit.WARMUP_REQUESTS
    llm.generate(inputs[:n], params[:n], use_tqdm=False)
    llm.reset_prefix_cache()
    llm.start_profile()
    t0 = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.stop_profile()
    traces = written_traces(folder)
    print(f"vLLM {vllm.__version__}, {a.workload} on {label}: profiled wall {wall:.2f} s "
          f"({sum(outs) / wall:,.0f} tok/s under the profiler); traces: {[p.name for p in traces]}")
    kernels = trace_kernels(traces)
    if not kernels:
        print("no GPU kernels in the traces")
        return 1
    print(table(kind_rows(kernels)))
    print(table(top_rows(kernels, a.top)))
    print(f"RESULT name=vllm_profile_{a.workload} {result_fields(kernels)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
