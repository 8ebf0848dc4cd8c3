"""Greedy tokens of a real model through the two attention backends on one GPU: the
torch backend and FlashInfer, both in bfloat16 (FlashInfer has no float32 kernels),
against the torch backend in float32 as the reference. Prints, per prompt, how many
leading tokens each pair agrees on.

    python -m benchmarks.backend_equality --model SmolLM2-135M-Instruct.Q4_1.gguf [--tokens 32]

On an offline GPU host the GGUF travels in parts (benchmarks/gpu/model_parts.sh says
how; then benchmarks/gpu/run.sh, step `model`)."""

from __future__ import annotations

import argparse

import sgl
from benchmarks.common import machine, table

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "import numpy as np\nx = np.arange(10)\n",
]


def generate(model: str, tokens: int, **kw: object) -> list[list[int]]:
    with sgl.Engine(model, transport="inproc", random_seed=0, **kw) as e:
        outs = e.generate(PROMPTS, {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True})
    return [o["output_ids"] for o in outs]


def agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a .gguf file or a Hugging Face model directory")
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    ref = generate(a.model, a.tokens, dtype="float32", attention_backend="torch", disable_cuda_graph=True)
    torch_bf16 = generate(a.model, a.tokens, dtype="bfloat16", attention_backend="torch", disable_cuda_graph=True)
    fi_bf16 = generate(a.model, a.tokens, dtype="bfloat16", attention_backend="flashinfer")
    rows = [{"prompt": p[:32].replace("\n", " "), "torch bf16 = flashinfer bf16": agree(t, f),
             "torch bf16 = fp32": agree(t, r), "flashinfer bf16 = fp32": agree(f, r)}
            for p, r, t, f in zip(PROMPTS, ref, torch_bf16, fi_bf16)]
    print(f"greedy agreement (leading tokens of {a.tokens}), {a.model} on {machine()}")
    print(table(rows))
    same = sum(t == f for t, f in zip(torch_bf16, fi_bf16))
    print(f"RESULT name=backend_equality prompts={len(PROMPTS)} torch_eq_flashinfer_bf16={same}")


if __name__ == "__main__":
    main()
