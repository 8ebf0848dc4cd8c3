"""Where a stream's time goes inside the engine, without HTTP: an AsyncEngine (its roles in
processes of their own, over ipc) serving C concurrent streams, or requests arriving at R a
second (Poisson, as W8's), each request's time to first token, its first gap (first to
second token) and its later gaps. Run beside W8 (benchmarks/w8_online.py, the same engine
behind `sgl serve`): what W8 measures above these numbers is the HTTP server's and the
client's.

Each variant (`--variants`, a JSON list of engine options; `{}` is the default engine)
starts an engine in turn and runs every point (`--concurrency`, then `--rates`). Prompts
are random ids, lengths uniform in `--prompt-len` (lo,hi), `--max-new` tokens each (lo,hi
for lengths uniform in a range; ignore_eos), temperature 0.6.
With `--tokenizer DIR` the model directory holds DIR's tokenizer (as W8's runs: the
engine detokenizes every token) and ids stay inside its vocabulary; without it the engine
loads no tokenizer. `--text` (with a tokenizer) runs each variant a second time with the
prompts sent as their decoded text, which the engine tokenizes as it does W8's requests.

    python -m benchmarks.stream_gaps [--model DIR] [--load-format dummy] [--tokenizer DIR]
        [--concurrency 1,4,16] [--rates 8,16] [--requests 32] [--prompt-len 100,1000] [--max-new 64]
        [--variants '[{}, {"disable_overlap_schedule": true}]'] [--text] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

from benchmarks.common import dummy_model_dir, machine, table, with_architecture
from benchmarks.w8_online import arrivals, percentiles

Prompt = list[int] | str  # ids, or text the engine tokenizes


async def stream_one(engine: Any, prompt: Prompt, max_new: int) -> tuple[float, list[float]]:
    """One streamed request: (TTFT, the gaps between chunks carrying tokens), in seconds."""
    params = {"temperature": 0.6, "max_new_tokens": max_new, "ignore_eos": True}
    t0 = time.perf_counter()
    times: list[float] = []
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    async for chunk in engine.stream(prompt=text, input_ids=ids, sampling_params=params):
        if chunk.get("output_ids"):
            times.append(time.perf_counter())
    if not times:
        raise RuntimeError("a stream ended without a token")
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


async def run_point(engine: Any, prompts: list[Prompt], max_new: list[int], concurrency: int | None = None,
                    rate: float | None = None, seed: int = 0) -> dict[str, Any]:
    """All prompts through `concurrency` workers, each sending its next when its last ends;
    or, with `rate`, each sent at its Poisson arrival time. Prompt i asks for max_new[i]."""
    results: list[tuple[float, list[float]]] = []
    t0 = time.perf_counter()
    if rate is None:
        todo = iter(range(len(prompts)))

        async def worker() -> None:
            for i in todo:
                results.append(await stream_one(engine, prompts[i], max_new[i]))

        await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
    else:
        async def at(i: int, when: float) -> None:
            await asyncio.sleep(max(0.0, t0 + when - time.perf_counter()))
            results.append(await stream_one(engine, prompts[i], max_new[i]))

        await asyncio.gather(*(at(i, w) for i, w in enumerate(arrivals(len(prompts), rate, seed))))
    wall = time.perf_counter() - t0
    point = f"c{concurrency}" if rate is None else f"r{rate:g}"
    row: dict[str, Any] = {"point": point, "requests": len(results),
                           "out_tok_s": round(sum(1 + len(g) for _, g in results) / wall, 1)}
    for name, xs in (("ttft", [t for t, _ in results]), ("first_gap", [g[0] for _, g in results if g]),
                     ("later_gap", [x for _, g in results for x in g[1:]])):
        q = percentiles(xs)  # ms
        row[f"{name}_p50"], row[f"{name}_p99"] = q["p50"], q["p99"]
    return row


async def run_variant(model: str, options: dict[str, Any], prompts: list[Prompt], a: argparse.Namespace,
                      tokenizer: bool, inputs: str = "ids") -> list[dict[str, Any]]:
    import sgl

    kw: dict[str, Any] = {"load_format": a.load_format, "random_seed": 0, "skip_tokenizer_init": not tokenizer,
                          **options}
    rows = []
    async with sgl.AsyncEngine(model, **kw) as engine:
        await run_point(engine, prompts[:4], [8] * 4, 2)  # warm-up: first-use costs out of the timed runs
        points = [{"concurrency": c} for c in a.concurrency] + [{"rate": r} for r in a.rates]
        for p in points:
            rows.append({"variant": json.dumps(options), "inputs": inputs,
                         **await run_point(engine, prompts, a.new_lens, seed=a.seed, **p)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model folder (default: the Qwen3-0.6B architecture)")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--tokenizer", default=None, help="a folder whose tokenizer the engine loads")
    ap.add_argument("--concurrency", default="1,4,16", help="concurrent streams; none: no such points")
    ap.add_argument("--rates", default="none", help="Poisson arrival rates, req/s; none (default): no such points")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", default="100,1000")
    ap.add_argument("--max-new", default="64", help="tokens out: N, or lo,hi (uniform)")
    ap.add_argument("--vocab", type=int, default=None, help="prompt ids below this (default: 10000, or the "
                    "tokenizer's vocabulary)")
    ap.add_argument("--variants", default="[{}]", help="a JSON list of engine options, one engine each")
    ap.add_argument("--text", action="store_true", help="with --tokenizer: each variant again, prompts as text")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.concurrency = [] if a.concurrency == "none" else [int(c) for c in a.concurrency.split(",")]
    a.rates = [] if a.rates == "none" else [float(r) for r in a.rates.split(",")]
    lo, hi = (int(x) for x in a.prompt_len.split(","))
    new_lo, new_hi = (int(x) for x in (a.max_new + "," + a.max_new).split(",")[:2])
    model = a.model or dummy_model_dir()
    vocab = a.vocab or 10000
    tok = None
    if a.tokenizer:
        model = with_architecture(a.tokenizer, "qwen3-0.6b") if a.model is None else model
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer)
        vocab = a.vocab or len(tok)
    rng = random.Random(a.seed)
    prompts: list[Prompt] = [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))]
                             for _ in range(a.requests)]
    a.new_lens = [rng.randint(new_lo, new_hi) for _ in prompts]
    texts: list[Prompt] = [tok.decode(p) for p in prompts] if tok is not None and a.text else []
    rows: list[dict[str, Any]] = []
    for options in json.loads(a.variants):
        rows += asyncio.run(run_variant(model, options, prompts, a, tok is not None))
        if texts:
            rows += asyncio.run(run_variant(model, options, texts, a, True, "text"))
    print(f"stream gaps on {machine()}, prompts {lo}-{hi} tokens, {new_lo}-{new_hi} new, ms")
    print(table(rows))
    print("RESULT stream_gaps " + " ".join(
        f"{r['variant'].replace(' ', '')}/{r['inputs']}@{r['point']}:first={r['first_gap_p50']},"
        f"later={r['later_gap_p50']}"
        for r in rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
