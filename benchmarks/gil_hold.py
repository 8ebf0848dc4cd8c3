"""How long calls that the engine makes in the caller's process hold the GIL: a ticker
thread sleeping 1 ms records its worst wake-up delay while each call runs (a call that
releases the GIL shows ~1 ms; one that holds it, about its own duration). Used to tell
which tokenizer calls can run in a worker thread without stalling the caller's loop.

    python benchmarks/gil_hold.py [--words 60000]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

from sgl.sched.models.default_model import default_model_dir


def held(fn: Callable[[], Any]) -> tuple[float, float]:
    """(the call's seconds, the ticker's worst delay in seconds) while `fn` runs."""
    lags: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    th = threading.Thread(target=tick)
    th.start()
    time.sleep(0.05)
    t = time.perf_counter()
    fn()
    took = time.perf_counter() - t
    stop.set()
    th.join()
    return took, max(lags)


def main(words: int) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = default_model_dir()
    vocab = "the quick brown fox jumps over the lazy dog near a quiet river bank".split()
    text = " ".join(vocab[j % len(vocab)] for j in range(words))
    raw = Tokenizer.from_file(path + "/tokenizer.json")
    hf = AutoTokenizer.from_pretrained(path)
    ids = hf.encode(text)
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("tokenizers Tokenizer.from_file (3.5 MB)", lambda: Tokenizer.from_file(path + "/tokenizer.json")),
        (f"tokenizers encode ({words} words)", lambda: raw.encode(text)),
        (f"tokenizers encode_batch ({words} words)", lambda: raw.encode_batch([text])),
        (f"transformers encode ({words} words)", lambda: hf.encode(text)),
        (f"transformers decode ({len(ids)} ids)", lambda: hf.decode(ids)),
    ]
    print(f"{'call':<48} {'took ms':>9} {'worst stall ms':>15}")
    for name, fn in calls:
        took, worst = held(fn)
        print(f"{name:<48} {took * 1000:9.1f} {worst * 1000:15.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=60000)
    main(ap.parse_args().words)
