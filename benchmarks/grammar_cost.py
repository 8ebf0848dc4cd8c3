"""What structured output costs: the same requests generated under
a JSON schema and plain, tokens per second each way and their ratio, and where a
grammar step's host time goes.

The constrained run goes first; the plain run then asks each request for exactly as
many tokens as its constrained output had (ignore_eos), so both runs have the same
batches step for step and the ratio is the grammar's cost alone (a plain run of full
length would compare a full batch with the constrained run's tail of short outputs).

Then the matchers alone, off the engine: `--requests` matchers of the schema stepped
together with a random allowed token each, timing per step the bitmask fill one by
one, xgrammar's batch fill over FILL_THREADS native threads (the engine's, from CHUNK_MIN rows:
sgl.sched.runner.grammar_masks), the token accepts (one batch call, as the engine; with --config,
also at the model's width, which the engine no longer uses), and on a GPU the bitmask's application.

    python -m benchmarks.grammar_cost [--requests 16] [--new-tokens 64] [--model DIR] [--dtype float32]
        [--load-format dummy]   # the H200 run: the default model's config and tokenizer (.lt), random bf16 weights
        [--config qwen3-0.6b]   # that architecture of benchmarks/configs (dummy weights) with --model's
                                # tokenizer (its token ids, EOS included; the logits keep the
                                # architecture's 151,936 columns, the ids past the tokenizer's are masked)
        [--w2]                  # W2-like: W2's prompts (100-1,024 ids), output caps (100-1,024) and T=0.6;
                                # the schema ends each output where it closes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import torch

import sgl
from benchmarks.common import allowed_ids, loop_split, with_architecture
from sgl.sched.grammar import tokenizer_width
from sgl.sched.models.default_model import default_model_dir
from sgl.sched.runner.grammar_masks import fill_threads

# An API-style record: short strings, an enum, bounded numbers, an array of objects.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["river", "lake", "sea", "glacier"]},
        "length_km": {"type": "integer", "minimum": 0, "maximum": 7000},
        "countries": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 6},
        "stations": {"type": "array", "maxItems": 12, "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0},
                           "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                           "depth_m": {"type": "number"}},
            "required": ["id", "code", "depth_m"], "additionalProperties": False}},
    },
    "required": ["title", "kind", "length_km", "countries", "stations"],
    "additionalProperties": False,
}


async def run(e: sgl.AsyncEngine, prompts: list[str] | list[list[int]],
              params: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    t = time.perf_counter()
    outs = await asyncio.gather(*(e.generate(p, sp) if isinstance(p, str) else
                                  e.generate(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)))
    return time.perf_counter() - t, outs


def check(outs: list[dict[str, Any]]) -> str:
    """The constrained outputs: how many closed (finish_reason stop) and, of those, how
    many parse (strict `json.loads`) and validate against the schema (where jsonschema is)."""
    try:
        from jsonschema import Draft202012Validator
        valid = Draft202012Validator(SCHEMA).is_valid
    except ImportError:
        valid = None

    def good(text: str) -> bool:
        try:
            doc = json.loads(text)
        except ValueError:
            return False
        return valid is None or bool(valid(doc))

    closed = [o["text"] for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    how = "parse and validate" if valid is not None else "parse (no jsonschema here)"
    return f"{len(closed)} of {len(outs)} outputs closed before their cap, {sum(map(good, closed))} of those {how}"


async def engine_runs(a: argparse.Namespace, model: str) -> None:
    prompts: list[str] | list[list[int]]
    if a.w2:  # W2's prompts (ids < 10,000, any tokenizer's), its output caps and temperature
        from benchmarks.w1_w2_gpu import workload

        prompts, caps, temp = workload("W2", a.requests)
    else:
        prompts = [f"Describe river number {i} as JSON:" for i in range(a.requests)]
        caps, temp = [a.new_tokens] * a.requests, 0.0
    schema = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    async with sgl.AsyncEngine(model, dtype=a.dtype, transport="ipc", load_format=a.load_format) as e:
        # Each phase says when it ends, so a run that stalls shows where.
        print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
        secs, _ = await run(e, prompts[:2], [{"max_new_tokens": 16, "json_schema": schema}] * 2)
        print(f"warm-up with the schema (its compile, then cached) in {secs:.1f} s", flush=True)
        await run(e, prompts[:2], [{"max_new_tokens": 4}] * 2)
        rows = []
        lens: list[int] = []
        for name in ("json_schema", "plain"):
            params = ([{"temperature": temp, "max_new_tokens": c, "json_schema": schema} for c in caps]
                      if name == "json_schema" else
                      [{"temperature": temp, "max_new_tokens": n, "ignore_eos": True} for n in lens])
            await e.flush_cache()
            i0 = await e.get_server_info()
            secs, outs = await run(e, prompts, params)
            got = [o["meta_info"]["completion_tokens"] for o in outs]
            lens = lens or got
            if name == "json_schema":
                print(f"json_schema: {check(outs)}", flush=True)
            rows.append((name, secs, sum(got), sum(got) / secs))
            print(f"{name}: scheduler loop {loop_split(i0, await e.get_server_info())}", flush=True)
    print(f"{'run':<12} {'seconds':>8} {'tokens':>7} {'tok/s':>9}")
    for name, secs, toks, rate in rows:
        print(f"{name:<12} {secs:8.2f} {toks:7d} {rate:9.1f}")
    print(f"json_schema / plain tok/s: {rows[0][3] / rows[1][3]:.3f} (outputs {min(lens)}-{max(lens)} tokens)")


def matcher_costs(model: str, n: int, steps: int = 40) -> None:
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    columns = AutoConfig.from_pretrained(model).vocab_size
    vocab = tokenizer_width(tok, columns)  # the engine's bitmask width
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=2)
    ms = [xgr.GrammarMatcher(compiled) for _ in range(n)]
    # The same matchers at the model's width (the engine masks the tokenizer's): xgrammar counts the ids
    # past the tokenizer's as special tokens and scans them on each accepted token.
    wide: list[Any] = []
    if columns > vocab:
        wide_info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=columns)
        c_wide = xgr.GrammarCompiler(wide_info).compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=2)
        wide = [xgr.GrammarMatcher(c_wide) for _ in range(n)]
    mask = xgr.allocate_token_bitmask(n, vocab)
    threads = fill_threads()
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    cuda = torch.cuda.is_available()
    logits = torch.randn(n, columns, device="cuda" if cuda else "cpu")
    rng = random.Random(0)
    xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device), vocab_size=vocab)  # Triton compiles once
    t = {"fill one by one": 0.0, f"batch fill ({threads} threads)": 0.0, "accept": 0.0, "apply on device": 0.0}
    if wide:
        t[f"accept, {columns:,}-wide"] = 0.0
    for _ in range(steps):
        live = [j for j, m in enumerate(ms) if not m.is_terminated()]
        if not live:
            break
        t0 = time.perf_counter()
        for j in live:
            ms[j].fill_next_token_bitmask(mask, j)
        t1 = time.perf_counter()
        batch.batch_fill_next_token_bitmask([ms[j] for j in live], mask, indices=live)
        t2 = time.perf_counter()
        dev = mask.to(logits.device)
        xgr.apply_token_bitmask_inplace(logits, dev, vocab_size=vocab)
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        bits = mask.numpy()
        toks = []
        for j in live:
            allowed = allowed_ids(bits[j], vocab)
            toks.append(int(rng.choice(allowed[:64].tolist())))
        t4 = time.perf_counter()
        xgr.BatchGrammarMatcher.batch_accept_token([ms[j] for j in live], toks)  # as the engine does
        t["accept"] += time.perf_counter() - t4
        if wide:
            t4 = time.perf_counter()
            xgr.BatchGrammarMatcher.batch_accept_token([wide[j] for j in live], toks)
            t[f"accept, {columns:,}-wide"] += time.perf_counter() - t4
        t["fill one by one"] += t1 - t0
        t[f"batch fill ({threads} threads)"] += t2 - t1
        t["apply on device"] += t3 - t2
    print(f"--- {n} matchers of the schema, ms per step over {steps} steps")
    for k, v in t.items():
        print(f"{k:<28} {v / steps * 1e3:7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--config", help="a benchmarks/configs architecture with --model's tokenizer (needs dummy)")
    ap.add_argument("--w2", action="store_true", help="W2's prompts, output caps and temperature (--requests of them)")
    a = ap.parse_args()
    model = a.model or default_model_dir()
    if a.config:
        if a.load_format != "dummy":
            ap.error("--config needs --load-format dummy (the architecture has no weights of its own)")
        model = with_architecture(model, a.config)
    asyncio.run(engine_runs(a, model))
    matcher_costs(model, a.requests)


if __name__ == "__main__":
    main()
