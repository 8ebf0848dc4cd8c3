"""How a grammar step's matcher work should be spread over threads, off the
engine: `--requests` matchers of a JSON schema take one allowed token each and fill their
next bitmasks while the scheduler's thread runs `--build-ms` of pure Python (standing in
for building the next batch), at the 0.2 ms GIL switch interval a scheduler's own process
uses (sgl.runtime.child). ms per step, from handing the work over to both the build and
the masks being done. Two arrangements, at each thread count of `--threads`:

- "xgrammar pool": the engine's MaskFiller (sgl.sched.runner.grammar_masks): one helper
  thread runs xgrammar's batch accept (serial) and then its threaded batch fill (which
  starts a pool of native threads at each call);
- "parts": contiguous parts on Python threads of their own, each part's accepts and fill
  on one native thread (tried inside the engine's MaskFiller and measured
  slower on the H200's host: each part's thread waits for the GIL between its native
  calls; here as that code did it).

    python -m benchmarks.grammar_threads [--requests 256] [--build-ms 0,2] [--threads 2,4,8] [--steps 60]
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

import torch

from benchmarks.common import allowed_ids, machine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def build(ms: float) -> int:
    t, x = time.perf_counter(), 0
    while time.perf_counter() - t < ms / 1e3:
        for i in range(100):
            x += i
    return x


class Rows:
    """`n` requests of the schema, each a Req holding its matcher; an ended one starts over."""

    def __init__(self, compiled: Any, n: int, width: int, eos: int) -> None:
        from sgl.sched.runner.grammar_masks import GrammarRows

        self.compiled, self.width, self.eos = compiled, width, eos
        self.reqs = [self._fresh(i) for i in range(n)]
        self.rows = GrammarRows(None, None, list(range(n)), self.reqs, [0] * n, width)
        self.rng = random.Random(0)

    def _fresh(self, i: int) -> Any:
        import xgrammar as xgr

        from sgl.core.sampling_params import SamplingParams
        from sgl.sched.req import Req

        r = Req(f"r{i}", [1], SamplingParams(max_new_tokens=1 << 20), False)
        r.grammar = xgr.GrammarMatcher(self.compiled)
        return r

    def sample(self, mask: torch.Tensor) -> list[int]:
        """One allowed token a row (never EOS while another is allowed), each appended
        to its request's output as the scheduler's results would; ended rows start over."""
        bits = mask.numpy()
        toks = []
        for j, r in enumerate(self.reqs):
            if r.grammar.is_terminated():
                self.reqs[j] = r = self._fresh(j)
                r.grammar.fill_next_token_bitmask(mask, j)
            allowed = allowed_ids(bits[j], self.width)[:64].tolist()
            t = int(self.rng.choice([a for a in allowed if a != self.eos] or allowed))
            r.output_ids.append(t)
            toks.append(t)
        return toks


def run(mode: str, rows: Rows, threads: int, build_ms: float, steps: int) -> float:
    """ms a step for `mode` over `steps` steps."""
    import xgrammar as xgr

    from sgl.sched.runner.grammar_masks import MaskFiller, accept_all

    filler = MaskFiller(torch.device("cpu"), frozenset([rows.eos]))
    filler.threads = threads
    pool = ThreadPoolExecutor(threads)
    ones = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(threads)]
    mask = filler.fill(rows.rows).mask
    n = len(rows.reqs)
    total = 0.0

    def part(entered: threading.Semaphore, k: int, toks: list[int]) -> None:
        # As the engine's fill thread: accept_all, and the rows that took EOS left out with no
        # call into xgrammar (each call lets go of the GIL and must take it back).
        entered.release()
        lo, hi = n * k // threads, n * (k + 1) // threads
        ms = [r.grammar for r in rows.reqs[lo:hi]]
        accept_all(ms, toks[lo:hi])
        live = [j for j in range(lo, hi) if toks[j] != rows.eos]
        ones[k].batch_fill_next_token_bitmask([ms[j - lo] for j in live], mask, indices=live)

    for _ in range(steps):
        toks = rows.sample(mask)
        t0 = time.perf_counter()
        if mode == "pool":
            started = filler.start(rows.rows)
            build(build_ms)
            mask = filler.finish(started).mask
        else:
            for r in rows.reqs:
                r.grammar_seen = len(r.output_ids)
            entered = threading.Semaphore(0)
            futures = [pool.submit(part, entered, k, toks) for k in range(threads)]
            for _ in range(threads):
                entered.acquire()
            build(build_ms)
            for f in futures:
                f.result()
        total += time.perf_counter() - t0
    pool.shutdown()
    filler.close()
    return total / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--build-ms", default="0,2")
    ap.add_argument("--threads", default="2,4,8")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", default=None, help="tokenizer directory (default: the default model's)")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from sgl.sched.grammar import _compiler_for
    from sgl.sched.models.default_model import default_model_dir

    path = a.model or default_model_dir()
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    compiler, width = _compiler_for(path, False, 1 << 20, (eos,))
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=2)
    print(f"{a.requests} matchers, vocabulary {width:,}, on {machine()}; ms a step")
    print("| build ms | threads | xgrammar pool | parts |\n|---|---|---|---|")
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    try:
        for build_ms in (float(b) for b in a.build_ms.split(",")):
            for threads in (int(t) for t in a.threads.split(",")):
                got = {}
                for mode in ("pool", "parts"):
                    rows = Rows(compiled, a.requests, width, eos)
                    run(mode, rows, threads, build_ms, 5)
                    got[mode] = run(mode, rows, threads, build_ms, a.steps)
                print(f"| {build_ms:g} | {threads} | {got['pool']:.2f} | {got['parts']:.2f} |", flush=True)
    finally:
        sys.setswitchinterval(before)


if __name__ == "__main__":
    main()
