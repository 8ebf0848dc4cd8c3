"""Where a grammar step's matcher work should run (issue 16), off the engine: `--requests`
matchers of a JSON schema take one allowed token each and fill their next bitmasks while
the scheduler's thread runs `--build-ms` of pure Python (standing in for building the
next batch). "serial": the accepts on that thread, then the fill on a helper thread while
it builds (sgl before session 14); "helper": accepts and fill both on the helper (since
session 14). Each at the interpreter's default GIL switch interval (5 ms) and at the
0.2 ms a scheduler's own process on a GPU now uses (sgl.runtime.child). ms per step,
from handing the work over to both the build and the matchers being done.

    python -m benchmarks.grammar_threads [--requests 256] [--build-ms 2] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks.common import machine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def build(ms: float) -> int:
    t, x = time.perf_counter(), 0
    while time.perf_counter() - t < ms / 1e3:
        for i in range(100):
            x += i
    return x


def run(mode: str, compiled: Any, vocab: int, eos: int, n: int, build_ms: float, steps: int, threads: int) -> float:
    import xgrammar as xgr

    rng = random.Random(0)
    pool = ThreadPoolExecutor(1)
    filler = xgr.BatchGrammarMatcher(max_threads=threads)
    mask = xgr.allocate_token_bitmask(n, vocab)
    ms = [xgr.GrammarMatcher(compiled) for _ in range(n)]
    filler.batch_fill_next_token_bitmask(ms, mask)
    total = 0.0

    def renew() -> None:  # a finished output starts over (an ended matcher is never filled)
        ms[:] = [xgr.GrammarMatcher(compiled) if m.is_terminated() else m for m in ms]

    def work(entered: threading.Event, toks: list[int] | None) -> None:
        entered.set()
        if toks is not None:  # helper: the accepts here too
            xgr.BatchGrammarMatcher.batch_accept_token(ms, toks)
            renew()
        filler.batch_fill_next_token_bitmask(ms, mask)

    for _ in range(steps):
        bits = mask.numpy()
        toks = []
        for j in range(n):
            allowed = np.nonzero(np.unpackbits(bits[j].view(np.uint8), bitorder="little")[:vocab])[0][:64].tolist()
            toks.append(int(rng.choice([a for a in allowed if a != eos] or allowed)))
        t0 = time.perf_counter()
        entered = threading.Event()
        if mode == "serial":
            xgr.BatchGrammarMatcher.batch_accept_token(ms, toks)
            renew()
        fut = pool.submit(work, entered, None if mode == "serial" else toks)
        entered.wait()
        build(build_ms)
        fut.result()
        total += time.perf_counter() - t0
    pool.shutdown()
    return total / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--build-ms", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from sgl.sched.models.default_model import default_model_dir
    from sgl.sched.runner.grammar_masks import fill_threads

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=2)
    threads = fill_threads()
    print(f"{a.requests} matchers, build {a.build_ms} ms, fill threads {threads}, on {machine()}")
    before = sys.getswitchinterval()
    try:
        for interval in (0.005, 0.0002):
            sys.setswitchinterval(interval)
            for mode in ("serial", "helper"):
                run(mode, compiled, info.vocab_size, tok.eos_token_id, a.requests, a.build_ms, 5, threads)
                ms = run(mode, compiled, info.vocab_size, tok.eos_token_id, a.requests, a.build_ms, a.steps, threads)
                print(f"switch interval {interval * 1e3:.1f} ms, {mode:<6}: {ms:.2f} ms a step", flush=True)
    finally:
        sys.setswitchinterval(before)


if __name__ == "__main__":
    main()
