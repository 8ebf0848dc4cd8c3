"""How much an engine setting changes greedy outputs on real weights (the accuracy
check for an FP8 KV cache and FP8 weights): the default model (or --model) generates
eight prompts' greedy continuations under a reference setting and under the one tested;
per prompt, how many tokens agree before the first difference, and up to there the
largest difference of the chosen tokens' log-probabilities. Then, along the reference's
continuations (teacher-forced), how often the tested setting's top prediction is the
reference's token.

    python -m benchmarks.kv_dtype_accuracy                                  # fp8_e4m3 cache vs auto, float32
    python -m benchmarks.kv_dtype_accuracy --kv auto --quantization fp8     # FP8 weights vs float32
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


def greedy(model: str | None, new_tokens: int, along: list[dict[str, Any]] | None = None,
           **kw: Any) -> tuple[list[dict[str, Any]], float]:
    """The prompts' greedy continuations and, with `along` (another run's continuations),
    the share of those tokens this engine's top prediction gives, teacher-forced."""
    with sgl.Engine(model, transport="inproc", random_seed=0, **kw) as e:
        outs = e.generate(PROMPTS, {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
                          return_logprob=True)
        return outs, top1_along(e, PROMPTS, along or [])


def top1_along(engine: sgl.Engine, prompts: list[str], continuations: list[dict[str, Any]]) -> float:
    """Along each prompt's continuation (another engine's output), the share of its tokens
    that are `engine`'s top prediction, teacher-forced: one prefill per prompt."""
    hits = total = 0
    for prompt, ref in zip(prompts, continuations):
        ids = engine.tokenizer.encode(prompt)
        got = engine.generate(input_ids=ids + ref["output_ids"],
                              sampling_params={"temperature": 0, "max_new_tokens": 1}, return_logprob=True,
                              logprob_start_len=len(ids) - 1, top_logprobs_num=1)
        tops = [row[0][1] for row in got["meta_info"]["input_top_logprobs"][1:]]  # row j + 1 predicts token j
        assert len(tops) == len(ref["output_ids"])
        hits += sum(a == b for a, b in zip(tops, ref["output_ids"]))
        total += len(tops)
    return hits / max(1, total)


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
    ap.add_argument("--quantization", default=None, help="quantization of the tested run (fp8)")
    ap.add_argument("--reference-dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=48)
    a = ap.parse_args()
    ref, _ = greedy(a.model, a.new_tokens, dtype=a.reference_dtype)
    got, top1 = greedy(a.model, a.new_tokens, ref, dtype=a.dtype, kv_cache_dtype=a.kv, quantization=a.quantization)
    agree, worst = [], 0.0
    for r, g in zip(ref, got):
        k, d = agreement(r, g)
        agree.append(k)
        worst = max(worst, d)
        print(f"agree for {k:3d}/{a.new_tokens} tokens, max |dlogprob| before the first difference {d:.3f}")
    print(f"kv_cache_dtype={a.kv} dtype={a.dtype} quantization={a.quantization} against dtype={a.reference_dtype}, "
          f"on {machine()}")
    mean = sum(agree) / len(agree)
    print(f"RESULT name=kv_accuracy mean_agree={mean:.1f} of={a.new_tokens} max_dlogprob={worst:.3f} "
          f"teacher_forced_top1={top1:.3f}")


if __name__ == "__main__":
    main()
