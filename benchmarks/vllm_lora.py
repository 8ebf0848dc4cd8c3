"""vLLM's multi-LoRA serving on benchmarks/lora_gpu.py's workload: the vLLM peer of that
script, on the same H200, with the same prompts and the same adapter files
(benchmarks/lora_adapters.py: W1's shape, requests round-robin over 0, 1, 8 and 32 random
PEFT adapters of rank 16 on q/k/v/o/gate/up/down).

Engine: `LLM(model=DIR, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
gpu_memory_utilization=0.85, max_num_seqs=256, seed=0)` as the vLLM peer's bench.py runs
it (vLLM's defaults otherwise), plus, for n adapters, `enable_lora=True,
max_loras=max(8, n), max_lora_rank=16, max_cpu_loras=max(8, n)` (every adapter fits one
batch and stays loaded; vLLM refuses max_cpu_loras below max_loras). The base variant
runs with LoRA off. A request names its adapter with `LoRARequest(name, i + 1, path)`.
Each variant is one engine in a process of its own (a start-up compiles once per LoRA
configuration; the compile cache under /tmp serves the next starts), in turn; a variant
that fails prints its error and the others still run. Per variant: the outputs-differ
check (base, lora0, lora1 on one prompt, OK/FAIL), a warm-up (one request per adapter at
least, 64 new tokens), a prefix cache reset, then the timed `generate` over all requests.
Throughput = requested output tokens / wall time of that call. vLLM's dummy weights are
not sgl's (the work, hence the throughput, does not depend on the values).
If a LoRA engine crashes under vLLM's model runner V2, run again with
VLLM_USE_V2_MODEL_RUNNER=0 set, and say so with the numbers.

On the GPU host, with the vLLM peer's parts unpacked in /tmp (../shared/peers/vllm/README.md;
benchmarks/gpu/run.sh's step `vllmlora` does this):

    eval "$(bash .peer/vllm/kit/unpack.sh .peer/vllm)" && python3 -m benchmarks.vllm_lora \\
        [--adapters 0,1,8,32] [--requests 256] [--config qwen3-0.6b] [--repeat K] [--rank 16]
        [--adapter-dir DIR] [--timeout 520] [--llm-kwargs JSON] [--json OUT.json]

The last line printed is `RESULT vllm-lora base=<tok/s> a1=<tok/s> a8=<tok/s> a32=<tok/s>`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from benchmarks.common import table
from benchmarks.lora_adapters import (
    adapter_names,
    add_workload_args,
    check_prompt,
    default_dir,
    load_config,
    warmup_requests,
    workload,
    write_adapters,
)
from benchmarks.vllm_beam import ENGINE_ENV

WARMUP_TOKENS = 64  # as lora_gpu.py
CHECK_TOKENS = 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What vLLM's LoRA path imports, to say which one a slimmed bundle lacks. A name absent
# from this vLLM version (moved or renamed) is reported as such, not as a failure.
LORA_MODULES = ("vllm.lora.request", "vllm.lora.peft_helper", "vllm.lora.utils", "vllm.lora.layers",
                "vllm.lora.punica_wrapper", "vllm.lora.ops.triton_ops", "vllm.lora.model_manager",
                "vllm.lora.worker_manager", "vllm.v1.worker.lora_model_runner_mixin")


def log(*a: object) -> None:
    print(*a, flush=True)


def variant_key(adapters: int) -> str:
    return f"a{adapters}" if adapters else "base"


def model_dir(config: str) -> str:
    """config.json and a generation_config.json of the special ids only (no sampling
    defaults), as the vLLM peer's bench.py writes them."""
    cfg, _ = load_config(config)
    name = os.path.basename(os.path.normpath(config)).removesuffix(".json")
    d = os.path.join(tempfile.gettempdir(), f"vllm-lora-{name}")
    os.makedirs(d, exist_ok=True)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    for fname, obj in (("config.json", cfg), ("generation_config.json", gen)):
        with open(os.path.join(d, fname), "w") as f:
            json.dump(obj, f, indent=1)
    return d


def report_lora_imports() -> bool:
    """Import each of LORA_MODULES and say which fail; False when one fails for a reason
    other than its own absence."""
    ok = True
    for m in LORA_MODULES:
        try:
            importlib.import_module(m)
            log(f"[vllm-lora] import ok   {m}")
        except ModuleNotFoundError as e:
            if e.name and (m == e.name or m.startswith(e.name + ".")):
                log(f"[vllm-lora] import --   {m}: not in this vLLM ({e.name} absent)")
            else:
                ok = False
                log(f"[vllm-lora] import FAIL {m}: needs {e.name!r}, which the bundle lacks ({e!r})")
        except Exception as e:  # noqa: BLE001 (a broken extension, a missing symbol: say which)
            ok = False
            log(f"[vllm-lora] import FAIL {m}: {e!r}")
    return ok


def llm_kwargs(a: argparse.Namespace, adapters: int) -> dict[str, Any]:
    kw: dict[str, Any] = dict(model=model_dir(a.config), load_format="dummy", skip_tokenizer_init=True,
                              dtype="bfloat16", gpu_memory_utilization=0.85, max_num_seqs=256, seed=0)
    if adapters:
        kw.update(enable_lora=True, max_loras=max(8, adapters), max_lora_rank=a.rank,
                  max_cpu_loras=max(8, adapters))
    if a.llm_kwargs:
        kw.update(json.loads(a.llm_kwargs))
    return kw


def outputs_differ(llm: Any, requests: list[Any], sampling_params: Any) -> str:
    """Greedy outputs of the base model and of the first two adapters on one prompt, in one
    batch: 'OK ...' when they all differ, else 'FAIL ...'."""
    who = [None, *requests[:2]]
    labels = ["base" if r is None else r.lora_name for r in who]
    try:
        res = llm.generate([{"prompt_token_ids": check_prompt()}] * len(who), sampling_params, lora_request=who,
                           use_tqdm=False)
        outs = [tuple(r.outputs[0].token_ids) for r in res]
    except Exception as err:  # noqa: BLE001 (reported; the timing still runs)
        traceback.print_exc()
        return f"FAIL ({err!r})"
    for label, out in zip(labels, outs):
        log(f"  check {label}: {list(out[:8])}...")
    same = [f"{labels[i]} == {labels[j]}" for i in range(len(outs)) for j in range(i + 1, len(outs))
            if outs[i] == outs[j]]
    return f"FAIL ({', '.join(same)})" if same else f"OK ({', '.join(labels)} all differ)"


def child(a: argparse.Namespace) -> int:
    """One variant in this process: writes its row to a.result as it goes."""
    n = a.child
    rec: dict[str, Any] = {"variant": variant_key(n), "adapters": n, "max_loras": max(8, n) if n else "-"}

    def save() -> None:
        with open(a.result, "w") as f:
            json.dump(rec, f, indent=1)

    save()
    try:
        return run_variant(a, n, rec, save)
    except BaseException as e:  # noqa: BLE001 (recorded in the row; the parent reports it)
        rec["error"] = repr(e)
        save()
        traceback.print_exc()
        return 1


def run_variant(a: argparse.Namespace, n: int, rec: dict[str, Any], save: Any) -> int:
    import vllm  # type: ignore[import-not-found]
    from vllm import LLM, SamplingParams

    kw = llm_kwargs(a, n)
    log(f"[vllm-lora] vllm {vllm.__version__}; {variant_key(n)}: LLM({', '.join(f'{k}={v!r}' for k, v in kw.items())})")
    t0 = time.perf_counter()
    llm = LLM(**kw)
    rec["start-up s"] = round(time.perf_counter() - t0, 1)
    save()
    log(f"[vllm-lora] {variant_key(n)}: start-up {rec['start-up s']} s")
    try:  # what vLLM resolved its defaults to (informational)
        vc = llm.llm_engine.vllm_config
        log(f"[vllm-lora] {variant_key(n)}: model runner V2 {getattr(vc, 'use_v2_model_runner', None)}, "
            f"compilation {vc.compilation_config.mode}, cudagraph {vc.compilation_config.cudagraph_mode}, "
            f"lora {vc.lora_config}")
    except Exception as e:  # noqa: BLE001
        log(f"[vllm-lora] (could not read the engine config: {e!r})")
    requests: list[Any] = []
    if n:
        from vllm.lora.request import LoRARequest  # type: ignore[import-not-found]

        adapter_dir = os.path.abspath(a.adapter_dir or default_dir(a.config, a.rank))
        requests = [LoRARequest(name, i + 1, os.path.join(adapter_dir, name))
                    for i, name in enumerate(adapter_names(n))]
    prompts, outs, loras = workload(a.requests, a.input_len, a.output_len, n)
    by_name = {r.lora_name: r for r in requests}
    per_request = [by_name[name] for name in loras if name] if n else None
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    if n:
        rec["check"] = outputs_differ(
            llm, requests, SamplingParams(max_tokens=CHECK_TOKENS, ignore_eos=True, temperature=0.0, detokenize=False))
        log(f"[vllm-lora] check {variant_key(n)}: {rec['check']}")
    k = warmup_requests(n)
    warm = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, temperature=0.0, detokenize=False)
    tw = time.perf_counter()
    llm.generate(inputs[:k], warm, lora_request=per_request[:k] if per_request else None, use_tqdm=False)
    if not llm.reset_prefix_cache():
        log(f"[vllm-lora] WARNING {variant_key(n)}: reset_prefix_cache() returned False")
    log(f"[vllm-lora] {variant_key(n)}: warm-up {time.perf_counter() - tw:.1f} s ({k} requests)")
    times: list[float] = []
    for _ in range(a.repeat):
        llm.reset_prefix_cache()
        t1 = time.perf_counter()
        res = llm.generate(inputs, params, lora_request=per_request, use_tqdm=False)
        times.append(time.perf_counter() - t1)
        got = [len(r.outputs[0].token_ids) for r in res]
        log(f"[vllm-lora] {variant_key(n)}: {times[-1]:.2f} s, {sum(outs) / times[-1]:,.0f} tok/s")
        if got != outs:
            log(f"[vllm-lora] WARNING {variant_key(n)}: {sum(g != o for g, o in zip(got, outs))} requests returned "
                f"another length than asked ({sum(got)} tokens, not {sum(outs)})")
        rec["runs tok/s"] = " ".join(f"{sum(outs) / t:,.0f}" for t in times)
        save()
    dt = sorted(times)[len(times) // 2]
    rec.update({"seconds": round(dt, 3), "tok/s": round(sum(outs) / dt, 1)})
    save()
    return 0


def run_child(n: int, a: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Variant n in a process (and process group) of its own; its row, with 'error' set
    when it failed or ran past the deadline."""
    fd, path = tempfile.mkstemp(prefix=f"vllm-lora-{variant_key(n)}-", suffix=".json")
    os.close(fd)
    left = deadline - time.monotonic()
    log(f"[vllm-lora] === {variant_key(n)} (time left {left:.0f} s)")
    if left < 60:
        return {"variant": variant_key(n), "adapters": n, "error": "skipped: less than 60 s left"}
    cmd = [sys.executable, "-m", "benchmarks.vllm_lora", "--child", str(n), "--result", path,
           "--requests", str(a.requests), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--config", a.config, "--repeat", str(a.repeat), "--rank", str(a.rank)]
    for opt, v in (("--adapter-dir", a.adapter_dir), ("--llm-kwargs", a.llm_kwargs)):
        if v:
            cmd += [opt, v]
    env = dict(os.environ)
    for k, v in ENGINE_ENV.items():
        env.setdefault(k, v)
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
    try:
        rc: int | str = p.wait(timeout=left)
    except subprocess.TimeoutExpired:
        log(f"[vllm-lora] {variant_key(n)} ran past the time budget; killing its process group")
        rc = "timeout"
    finally:
        try:  # the engine core shares the child's process group
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()
        t1 = time.monotonic()
        while time.monotonic() - t1 < 30:  # until the group is gone and the GPU memory free
            try:
                os.killpg(p.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.5)
    try:
        with open(path) as f:
            row: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as e:
        row = {"variant": variant_key(n), "adapters": n, "error": f"no result file ({e!r})"}
    os.unlink(path)
    if "tok/s" not in row:
        row["error"] = row.get("error") or f"exit {rc}"
        log(f"[vllm-lora] ERROR {variant_key(n)}: {row['error']} (its output above says why)")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--timeout", type=float, default=520, help="seconds for all variants together")
    ap.add_argument("--llm-kwargs", default=None, help="JSON dict of extra LLM(...) arguments, for every variant")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    if a.child is not None:
        return child(a)
    deadline = time.monotonic() + a.timeout
    counts = [int(c) for c in a.adapters.split(",") if c]
    if max(counts):
        write_adapters(a.adapter_dir or default_dir(a.config, a.rank), a.config, max(counts), a.rank)
        report_lora_imports()  # here, not in the engines' processes: no CUDA context of its own there
    log(f"[vllm-lora] {a.config}, {a.requests} requests x {a.input_len} in, {a.output_len} out, greedy; adapters "
        f"of rank {a.rank} on q/k/v/o/gate/up/down, round-robin over the requests; max_loras = max(8, adapters): "
        "every adapter fits one batch")
    rows = [run_child(n, a, deadline) for n in counts]
    rates = {r["variant"]: float(r["tok/s"]) for r in rows if "tok/s" in r}
    base = rates.get("base")
    cols = ("variant", "adapters", "max_loras", "seconds", "tok/s", "vs base", "runs tok/s", "start-up s", "check")
    shown = []
    for r in rows:
        r["vs base"] = f"{r['tok/s'] / base:.2f}" if base and "tok/s" in r else "-"
        shown.append({c: r.get(c, "-") for c in cols})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    log(table(shown))
    for r in rows:
        if r.get("error"):
            log(f"[vllm-lora] {r['variant']}: {r['error']}")
    log("RESULT vllm-lora " + " ".join(f"{k}={rates[k]:.0f}" if k in rates else f"{k}=nan"
                                      for k in map(variant_key, counts)))
    return 0 if len(rates) == len(counts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
