"""A soak: many requests over ipc with random aborts, streams, n > 1 and shared
prefixes on a small KV pool, through the null model (whose greedy continuation is
known: `null_next_token`). Every request must end; every output must be exact (a
whole continuation, or for an aborted one a prefix of it); the KV accounting must
balance with zero leaked slots; each role's memory is reported at the start and end.

    python -m benchmarks.soak [--requests 10000] [--concurrency 64] [--pool 1200]

Prints one table, then `RESULT soak ...`; exits non-zero on any violation."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from typing import Any

import sgl
from benchmarks.common import machine, table
from sgl.sched.models.null import null_next_token

VOCAB = 1000


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def null_model_dir() -> str:
    d = tempfile.mkdtemp(prefix="sgl-soak-model-")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 1024, "eos_token_id": VOCAB - 1, "bos_token_id": 0}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def expected(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = null_next_token(last, VOCAB)
        out.append(last)
    return out


class Tally:
    def __init__(self) -> None:
        self.done = self.aborted = self.streamed = self.samples = 0
        self.errors: list[str] = []


async def one(e: sgl.AsyncEngine, rng: random.Random, prefixes: list[list[int]], i: int, t: Tally) -> None:
    prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(1, 40))]
    m = rng.randrange(1, 48)
    n = rng.choice([1, 1, 1, 2, 4])
    sp: dict[str, Any] = {"max_new_tokens": m, "temperature": 0, "ignore_eos": True, "n": n}
    want = expected(prompt, m)
    abort_after = rng.random() < 0.2
    rid = f"soak-{i}"
    if rng.random() < 0.4:  # a stream, maybe left early (which aborts its samples)
        got: dict[int, list[int]] = {}
        stop_at = rng.randrange(1, 8) if abort_after else None
        chunks = 0
        async for c in e.stream(input_ids=prompt, sampling_params=sp, rid=rid):
            got.setdefault(c.get("index", 0), []).extend(c["output_ids"])
            chunks += 1
            if stop_at is not None and chunks >= stop_at:
                break
        t.streamed += 1
        for k, ids in got.items():
            if ids != want[: len(ids)] or (stop_at is None and len(ids) != m):
                t.errors.append(f"{rid} sample {k}: stream {ids[:8]}... is not the continuation")
        t.aborted += stop_at is not None
    else:
        task = asyncio.ensure_future(e.generate(input_ids=prompt, sampling_params=sp, rid=rid))
        if abort_after:
            await asyncio.sleep(rng.random() * 0.02)
            await e.abort(rid)
        out = await task
        outs = out if isinstance(out, list) else [out]
        for o in outs:
            fin = o["meta_info"]["finish_reason"]
            ids = o["output_ids"]
            if fin["type"] == "abort":
                t.aborted += 1
                ok = ids == want[: len(ids)]
            else:
                ok = ids == want
            if not ok:
                t.errors.append(f"{rid}: {fin} output {ids[:8]}... is not the continuation")
    t.samples += n
    t.done += 1


async def main_async(a: argparse.Namespace) -> int:
    rng = random.Random(a.seed)
    prefixes = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(20, 200))] for _ in range(8)]
    t = Tally()
    async with sgl.AsyncEngine(null_model_dir(), transport="ipc", load_format="null", skip_tokenizer_init=True,
                               max_total_tokens=a.pool, max_running_requests=64, chunked_prefill_size=256,
                               disable_overlap_schedule=False) as e:
        pids = dict(e.roles.pids())
        pids["tokenizer_manager"] = os.getpid()
        await e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
        rss0 = {k: rss_mib(p) for k, p in pids.items()}
        sem = asyncio.Semaphore(a.concurrency)
        t0 = time.perf_counter()

        async def bounded(i: int) -> None:
            async with sem:
                await one(e, rng, prefixes, i, t)

        # In waves, so the memory after each wave compares like with like (a leak grows
        # wave over wave; the first wave warms the allocators).
        waves: list[dict[str, float]] = []
        for start in range(0, a.requests, a.wave):
            await asyncio.gather(*(bounded(i) for i in range(start, min(start + a.wave, a.requests))))
            waves.append({k: rss_mib(p) for k, p in pids.items()})
        dt = time.perf_counter() - t0
        rss1 = waves[-1]
        rss_first = waves[0]
        tm_states = len(e.tm.states)  # requests the tokenizer manager still tracks: 0 once all ended
        info = await e.get_server_info()
        for _ in range(100):  # aborts of streams left early arrive after their last chunk
            if info["running"] == 0 and info["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
            info = await e.get_server_info()
    leaked = info["max_total_tokens"] - info["kv_free"] - info["kv_evictable"]
    rows = [{"role": k, "RSS start MiB": round(rss0[k], 1), "after wave 1": round(rss_first[k], 1),
             f"after wave {len(waves)}": round(rss1[k], 1)} for k in pids]
    print(machine())
    print(table(rows))
    print(table([{"requests": t.done, "samples": t.samples, "streamed": t.streamed, "aborted": t.aborted,
                  "errors": len(t.errors), "seconds": round(dt, 1), "retractions": info["retractions"],
                  "leaked KV slots": leaked, "protected": info["kv_protected"], "TM states left": tm_states,
                  "invariant violations": info["invariant_violations"]}]))
    for err in t.errors[:10]:
        print("ERROR", err)
    ok = t.done == a.requests and not t.errors and leaked == 0 and info["kv_protected"] == 0 \
        and info["invariant_violations"] == 0 and tm_states == 0
    print(f"RESULT soak requests={t.done} errors={len(t.errors)} leaked={leaked} seconds={dt:.1f} ok={ok} "
          + " ".join(f"rss_{k}={rss0[k]:.0f}/{rss_first[k]:.0f}->{rss1[k]:.0f}MiB" for k in pids))
    return 0 if ok else 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--pool", type=int, default=1200, help="KV slots: small enough to force eviction and retraction")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wave", type=int, default=1000, help="requests per wave; memory is read after each")
    raise SystemExit(asyncio.run(main_async(ap.parse_args())))


if __name__ == "__main__":
    main()
