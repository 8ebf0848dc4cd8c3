"""Multi-LoRA serving throughput on a GPU: W1's shape (256 requests x 512 random input ids
x 512 output tokens, greedy, ignore_eos; Qwen3-0.6B architecture, dummy bf16 weights)
with the requests spread round-robin over 0 (the base model alone, LoRA off), 1, 8 and 32
adapters: random PEFT adapters of rank 16 on all seven projections
(benchmarks/lora_adapters.py). Each variant runs in its own engine, in turn, with
max_loras_per_batch = max(8, adapters), so every adapter fits one batch.
Throughput = requested output tokens / wall time; engine start-up (adapters loaded
included) and warm-up (one request per adapter at least, 64 new tokens) excluded.
Before its warm-up, each LoRA engine checks that two adapters and the base model give
three different greedy outputs on one prompt (OK/FAIL; the run goes on either way).
The vLLM peer on the same inputs: benchmarks/vllm_lora.py.

    python -m benchmarks.lora_gpu [--adapters 0,1,8,32] [--requests 256] [--config qwen3-0.6b]
        [--repeat K] [--rank 16] [--adapter-dir DIR] [--engine-kw JSON] [--json OUT.json]
        [--input-len 512] [--output-len 512] [--device cpu]   # scaled down, for a CPU

benchmarks/gpu/run.sh's step `lora` runs it on the GPU host.

The last line printed is `RESULT lora base=<tok/s> a1=<tok/s> a8=<tok/s> a32=<tok/s>`.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Any

import sgl
from benchmarks.common import dummy_model_dir, loop_split, machine, table
from benchmarks.lora_adapters import (
    adapter_names,
    add_workload_args,
    check_prompt,
    default_dir,
    warmup_requests,
    workload,
    write_adapters,
)

WARMUP_TOKENS = 64
CHECK_TOKENS = 16


def variant_key(adapters: int) -> str:
    return f"a{adapters}" if adapters else "base"


def outputs_differ(e: Any, names: list[str]) -> str:
    """Greedy outputs of the base model and of the first two adapters on one prompt, in one
    batch: 'OK ...' when they all differ, else 'FAIL ...'."""
    who: list[str | None] = [None, *names[:2]]
    try:
        res = e.generate(input_ids=[check_prompt()] * len(who),
                         sampling_params={"temperature": 0, "max_new_tokens": CHECK_TOKENS, "ignore_eos": True},
                         lora_path=who)
        outs = [tuple(r["output_ids"]) for r in res]
    except Exception as err:  # noqa: BLE001 (reported; the timing still runs)
        traceback.print_exc()
        return f"FAIL ({err!r})"
    labels = ["base" if w is None else w for w in who]
    for label, out in zip(labels, outs):
        print(f"  check {label}: {list(out[:8])}...", flush=True)
    same = [f"{labels[i]} == {labels[j]}" for i in range(len(outs)) for j in range(i + 1, len(outs))
            if outs[i] == outs[j]]
    return f"FAIL ({', '.join(same)})" if same else f"OK ({', '.join(labels)} all differ)"


def run_variant(model_dir: str, adapters: int, paths: dict[str, str], a: argparse.Namespace) -> dict[str, object]:
    prompts, outs, loras = workload(a.requests, a.input_len, a.output_len, adapters)
    names = adapter_names(adapters)
    kw: dict[str, Any] = dict(a.engine_kw)
    if a.device != "auto":
        kw["device"] = a.device
    per_batch = max(8, adapters)
    if adapters:
        kw.update(lora_paths=[f"{n}={paths[n]}" for n in names], max_lora_rank=a.rank, max_loras_per_batch=per_batch)
        if adapters > 64:
            kw["max_loaded_loras"] = adapters
    lora_kw: dict[str, Any] = {"lora_path": loras} if adapters else {}
    params = {"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True}
    k = warmup_requests(adapters)
    times: list[float] = []
    check = "-"
    t0 = time.perf_counter()
    with sgl.Engine(model_dir, transport="ipc", load_format="dummy", skip_tokenizer_init=True, random_seed=0,
                    log_level="info", **kw) as e:
        start_s = time.perf_counter() - t0
        print(f"{variant_key(adapters)}: engine ready in {start_s:.1f} s", flush=True)
        if adapters:
            check = outputs_differ(e, names)
            print(f"check {variant_key(adapters)}: {check}", flush=True)
        warm: dict[str, Any] = {"lora_path": loras[:k]} if adapters else {}
        e.generate(input_ids=prompts[:k], sampling_params={**params, "max_new_tokens": WARMUP_TOKENS}, **warm)
        for _ in range(a.repeat):
            e.flush_cache()
            i0 = e.get_server_info()
            t1 = time.perf_counter()
            res = e.generate(input_ids=prompts, sampling_params=params, **lora_kw)
            times.append(time.perf_counter() - t1)
            split = loop_split(i0, e.get_server_info())
            print(f"{variant_key(adapters)}: {times[-1]:.2f} s, scheduler loop {split}", flush=True)
            got = [len(r["output_ids"]) for r in res]
            if got != outs:
                print(f"WARNING {variant_key(adapters)}: {sum(g != o for g, o in zip(got, outs))} requests returned "
                      f"another length than asked ({sum(got)} tokens, not {sum(outs)})", flush=True)
    dt = sorted(times)[len(times) // 2]
    tokens = sum(outs)
    return {"variant": variant_key(adapters), "adapters": adapters,
            "max_loras_per_batch": per_batch if adapters else "-", "seconds": dt, "tok/s": tokens / dt,
            "vs base": "-", "runs tok/s": " ".join(f"{tokens / t:,.0f}" for t in times), "start-up s": start_s,
            "check": check}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--engine-kw", type=json.loads, default={}, help="engine options as JSON, for every engine")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args()
    counts = [int(c) for c in a.adapters.split(",") if c]
    model_dir = dummy_model_dir(a.config)
    paths = write_adapters(a.adapter_dir or default_dir(a.config, a.rank), a.config, max(counts), a.rank) \
        if max(counts) else {}
    print(f"LoRA on {machine()}: {a.config}, {a.requests} requests x {a.input_len} in, {a.output_len} out, greedy; "
          f"adapters of rank {a.rank} on q/k/v/o/gate/up/down, round-robin over the requests; "
          f"max_loras_per_batch = max(8, adapters): every adapter fits one batch", flush=True)
    rows: list[dict[str, object]] = []
    rates: dict[str, float] = {}
    for n in counts:
        try:
            row = run_variant(model_dir, n, paths, a)
        except Exception as err:  # noqa: BLE001 (report it and go on with the next variant)
            traceback.print_exc()
            print(f"ERROR {variant_key(n)}: {err!r}", flush=True)
            continue
        rows.append(row)
        rates[variant_key(n)] = float(row["tok/s"])  # type: ignore[arg-type]
    base = rates.get("base")
    for row in rows:
        row["vs base"] = f"{float(row['tok/s']) / base:.2f}" if base else "-"  # type: ignore[arg-type]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if rows:
        print(table(rows))
    print("RESULT lora " + " ".join(f"{k}={rates[k]:.0f}" if k in rates else f"{k}=nan"
                                    for k in map(variant_key, counts)))
    return 0 if len(rows) == len(counts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
