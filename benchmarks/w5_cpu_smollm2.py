"""W5 (BENCHMARKS.md): SmolLM2-135M, float32, CPU, 16 requests x 128 input ids x 64
output tokens, greedy, ignore_eos; against Hugging Face `generate` (static batch)
on the same weights, in the same run.

    python benchmarks/w5_cpu_smollm2.py [--requests 16] [--input 128] [--output 64]
"""

from __future__ import annotations

import argparse
import time

import torch

import sgl
from benchmarks.common import machine, random_prompts, table


def run_sgl(model_dir: str, prompts: list[list[int]], out_len: int, transport: str) -> float:
    params = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    with sgl.Engine(model_dir, transport=transport, dtype="float32") as e:
        e.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})  # warm-up
        e.flush_cache()
        t0 = time.perf_counter()
        outs = e.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == out_len for o in outs)
    return dt


def run_hf(model_dir: str, prompts: list[list[int]], out_len: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                             do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + out_len
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--transport", default="ipc")
    a = ap.parse_args()
    from sgl.sched.models.default_model import default_model_dir

    model_dir = default_model_dir()
    prompts = random_prompts(a.requests, a.input, 49152)
    tokens = a.requests * a.output
    t_sgl = run_sgl(model_dir, prompts, a.output, a.transport)
    t_hf = run_hf(model_dir, prompts, a.output)
    rows = [
        {"engine": "sgl", "seconds": t_sgl, "tok/s": tokens / t_sgl},
        {"engine": "hf generate", "seconds": t_hf, "tok/s": tokens / t_hf},
    ]
    print(f"W5 on {machine()}, torch {torch.__version__}, {a.requests} x {a.input} in x {a.output} out, float32")
    print(table(rows))
    print(f"RESULT name=W5 sgl_tok_s={tokens / t_sgl:.1f} hf_tok_s={tokens / t_hf:.1f} ratio={t_hf / t_sgl:.2f}")


if __name__ == "__main__":
    main()
