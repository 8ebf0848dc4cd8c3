"""A prompt's encode on a tokenizer thread while its process's loop is busy, as in the
detokenizer's process (sgl.runtime.detokenizer: the loop detokenizes every step's outputs,
a thread pool encodes the prompts): the encode's wall time and the loop's longest slice,
at each GIL switch interval of `--intervals` (ms). A fast tokenizer encodes in Rust with
the GIL released, but the Python around that call waits for the busy loop to give the
GIL up, up to one interval each time, and the loop waits as long the other way.

    python -m benchmarks.tokenizer_turns [--tokenizer DIR] [--words 800] [--seconds 2] [--intervals 5,0.2]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import machine, table
from benchmarks.w8_online import WORDS


def busy_slice() -> float:
    """One slice of the loop's pure-Python work (~0.1 ms); its seconds."""
    t = time.perf_counter()
    sum(i * i for i in range(2000))
    return time.perf_counter() - t


def measure(tok: object, text: str, seconds: float, interval_s: float) -> dict[str, float]:
    """Encodes one after another on a worker thread, the loop busy until each is done."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    walls: list[float] = []
    slices: list[float] = []
    try:
        with ThreadPoolExecutor(1) as pool:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t = time.perf_counter()
                job = pool.submit(tok, [text])  # type: ignore[arg-type]
                while not job.done():
                    slices.append(busy_slice())
                walls.append(time.perf_counter() - t)
    finally:
        sys.setswitchinterval(before)
    walls.sort()
    return {"interval ms": interval_s * 1e3, "encodes": len(walls), "encode p50 ms": walls[len(walls) // 2] * 1e3,
            "encode p90 ms": walls[int(len(walls) * 0.9)] * 1e3, "loop slice max ms": max(slices) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the default model's)")
    ap.add_argument("--words", type=int, default=800)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--intervals", default="5,0.2", help="GIL switch intervals to compare, ms")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    if a.tokenizer is None:
        from sgl.sched.models.default_model import default_model_dir

        a.tokenizer = default_model_dir()
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    rng = random.Random(0)
    words = " ".join(WORDS).split()
    text = " ".join(rng.choice(words) for _ in range(a.words))
    t = time.perf_counter()
    n = len(tok([text])["input_ids"][0])
    idle = (time.perf_counter() - t) * 1e3
    rows = [measure(tok, text, a.seconds, float(ms) / 1e3) for ms in a.intervals.split(",")]
    print(f"a {n}-token prompt's encode beside a busy loop on {machine()} (idle: {idle:.2f} ms)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
