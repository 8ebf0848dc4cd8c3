"""How much an engine setting changes greedy outputs on real weights (the accuracy
check for an FP8 KV cache): the default model (or --model) generates eight prompts'
greedy continuations under a reference setting and under the one tested; per prompt,
how many tokens agree before the first difference, and up to there the largest
difference of the chosen tokens' log-probabilities.

    python -m benchmarks.kv_dtype_accuracy                                  # fp8_e4m3 cache vs auto, float32
    python -m benchmarks.kv_dtype_accuracy --kv auto --dtype bfloat16       # bf16 compute vs float32 (a yardstick)
    python -m benchmarks.kv_dtype_accuracy --dtype bfloat16 --reference-dtype bfloat16   # on a GPU
"""

from __future__ import annotations

import argparse
from typing import Any

import sgl
from benchmarks.common import machine

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "Water boils at", "In 1969, the first human",
           "A list of prime numbers: 2, 3, 5,", "The best way to learn Python is"]


def greedy(model: str | None, new_tokens: int, **kw: Any) -> list[dict[str, Any]]:
    with sgl.Engine(model, transport="inproc", random_seed=0, **kw) as e:
        return e.generate(PROMPTS, {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
                          return_logprob=True)


def agreement(ref: dict[str, Any], got: dict[str, Any]) -> tuple[int, float]:
    """Two greedy outputs of one prompt: how many tokens agree before the first difference,
    and up to there the largest difference of the chosen tokens' log-probabilities."""
    a, b = ref["output_ids"], got["output_ids"]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    d = max((abs(x[0] - y[0]) for x, y in zip(ref["meta_info"]["output_token_logprobs"][:k],
                                               got["meta_info"]["output_token_logprobs"][:k])), default=0.0)
    return k, d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model directory or .gguf (default: the default model)")
    ap.add_argument("--kv", default="fp8_e4m3", help="kv_cache_dtype of the tested run")
    ap.add_argument("--dtype", default="float32", help="dtype of the tested run")
    ap.add_argument("--reference-dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=48)
    a = ap.parse_args()
    ref = greedy(a.model, a.new_tokens, dtype=a.reference_dtype)
    got = greedy(a.model, a.new_tokens, dtype=a.dtype, kv_cache_dtype=a.kv)
    agree, worst = [], 0.0
    for r, g in zip(ref, got):
        k, d = agreement(r, g)
        agree.append(k)
        worst = max(worst, d)
        print(f"agree for {k:3d}/{a.new_tokens} tokens, max |dlogprob| before the first difference {d:.3f}")
    print(f"kv_cache_dtype={a.kv} dtype={a.dtype} against dtype={a.reference_dtype}, on {machine()}")
    mean = sum(agree) / len(agree)
    print(f"RESULT name=kv_accuracy mean_agree={mean:.1f} of={a.new_tokens} max_dlogprob={worst:.3f}")


if __name__ == "__main__":
    main()
