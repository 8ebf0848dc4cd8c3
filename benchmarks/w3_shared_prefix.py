"""W3 (BENCHMARKS.md): requests sharing one long system prompt, radix cache on
(with the default cascade attention over the shared prefix on flashinfer, and
without it) against off, same engine, same run. 256 requests x (2,000 shared + 100 unique
ids), 128 output tokens, greedy, ignore_eos, Qwen3-0.6B architecture with dummy
weights. Scale it down for a CPU with the flags.

    python -m benchmarks.w3_shared_prefix [--requests 256 --prefix 2000 --unique 100 --output 128]
        [--chunked-prefill-size N] [--variants cascade,radix,off] [--repeat 5]
        [--engine-kw '{"tensor_core_decode_min_batch": 100000}']   # options for every engine

--repeat N times the workload N times in each engine (the cache flushed before each)
and reports the median: one W3 run is ~1 s with the cache, too short for one number
to tell a 10% change from a machine's noise.
"""

from __future__ import annotations

import argparse
import json
import time

import sgl
from benchmarks.common import dummy_model_dir, loop_split, machine, random_prompts, table


def w3_prompts(requests: int = 256, prefix: int = 2000, unique: int = 100) -> list[list[int]]:
    """W3's prompts: one shared prefix, then each request's own ids (the vLLM kit builds the same)."""
    shared = random_prompts(1, prefix, 151000, seed=5)[0]
    return [shared + u for u in random_prompts(requests, unique, 151000, seed=6)]


def run(model_dir: str, prompts: list[list[int]], a: argparse.Namespace, radix: bool,
        cascade: bool | None) -> dict[str, object]:
    params = {"temperature": 0, "max_new_tokens": a.output, "ignore_eos": True}
    kw: dict[str, object] = dict(a.engine_kw) if a.device == "auto" else {"device": a.device, **a.engine_kw}
    if a.chunked_prefill_size is not None:
        kw["chunked_prefill_size"] = a.chunked_prefill_size
    times = []
    with sgl.Engine(model_dir, transport="ipc", load_format="dummy", skip_tokenizer_init=True,
                    disable_radix_cache=not radix, enable_cascade_attention=cascade, random_seed=0, **kw) as e:
        e.generate(input_ids=[list(range(1, 40))], sampling_params={**params, "max_new_tokens": 4})
        for _ in range(a.repeat):
            e.flush_cache()
            i0 = e.get_server_info()
            t0 = time.perf_counter()
            outs = e.generate(input_ids=prompts, sampling_params=params)
            times.append(time.perf_counter() - t0)
            split = loop_split(i0, e.get_server_info())
            print(f"radix {radix}, cascade {cascade}: {times[-1]:.2f} s, scheduler loop {split}", flush=True)
    dt = sorted(times)[len(times) // 2]
    steps = int(split["cascade_steps"])
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return {"radix cache": "on" if radix else "off", "cascade": "off" if cascade is False else "default",
            "cascade steps": steps, "seconds": dt, "tok/s": len(prompts) * a.output / dt,
            "cached tokens": cached, "runs tok/s": " ".join(f"{len(prompts) * a.output / t:,.0f}" for t in times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--unique", type=int, default=100)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--chunked-prefill-size", type=int, default=None,
                    help="prefill tokens per forward (default: the engine's, 16384 on an H200; -1: no chunking)")
    ap.add_argument("--variants", default="cascade,radix,off",
                    help="which engines: radix cache with cascade (the default), radix without cascade, cache off")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per engine; the median is reported")
    ap.add_argument("--engine-kw", type=json.loads, default={}, help="engine options as JSON, for every engine")
    a = ap.parse_args()
    model_dir = dummy_model_dir()
    prompts = w3_prompts(a.requests, a.prefix, a.unique)
    engines = {"cascade": (True, None), "radix": (True, False), "off": (False, None)}
    rows = {v: run(model_dir, prompts, a, *engines[v]) for v in a.variants.split(",")}
    print(f"W3 on {machine()}: {a.requests} x ({a.prefix} shared + {a.unique}) in, {a.output} out")
    print(table(list(rows.values())))
    tok = {v: f"{r['tok/s']:.0f}" for v, r in rows.items()}
    print("RESULT name=W3 " + " ".join(f"{k}_tok_s={v}" for k, v in tok.items()))


if __name__ == "__main__":
    main()
