"""W1 and W2 (BENCHMARKS.md) on a GPU: Qwen3-0.6B architecture, dummy bf16 weights.

W1: 256 requests x 512 random input ids x 512 output tokens, greedy.
W2: 256 requests, input and output lengths uniform in [100, 1024], ids uniform in
    [0, 10000), seed 0, temperature 0.6.
Peer in the same run: Hugging Face `generate` (static batch, sdpa, left-padded;
for W2 it runs to the longest output, and its throughput counts useful tokens).
Throughput = requested output tokens / wall time, start-up and warm-up excluded.

    python -m benchmarks.w1_w2_gpu [--workloads W1,W2] [--no-hf] [--requests 256]
        [--config qwen3-8b] [--tp-size 2] [--dp-size 2]   # a bigger model over GPUs
        [--variant '{"tensor_core_decode_min_batch": 100000}' ...]   # engine options, each run in turn
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import sgl
from benchmarks.common import dummy_model_dir, loop_split, machine, random_prompts, table, w2_requests

FLOOR_W1_TOK_S = 44_000  # BENCHMARKS.md: the memory-bound floor of W1 on an H200


def workload(name: str, n: int) -> tuple[list[list[int]], list[int], float]:
    if name == "W1":
        return random_prompts(n, 512, 151000), [512] * n, 0.0
    prompts, outs = w2_requests(n)
    return prompts, outs, 0.6


def run_sgl(model_dir: str, prompts: list[list[int]], outs: list[int], temp: float, **kw: object) -> float:
    params = [{"temperature": temp, "max_new_tokens": o, "ignore_eos": True} for o in outs]
    with sgl.Engine(model_dir, transport="ipc", load_format="dummy", skip_tokenizer_init=True, random_seed=0,
                    log_level="info", **kw) as e:
        e.generate(input_ids=prompts[:8], sampling_params=params[:8])  # warm-up
        e.flush_cache()
        i0 = e.get_server_info()
        t0 = time.perf_counter()
        res = e.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        i1 = e.get_server_info()
    print(f"sgl {kw or ''}: {dt:.2f} s, scheduler loop {loop_split(i0, i1)}", flush=True)
    assert [len(r["output_ids"]) for r in res] == outs
    return dt


def run_hf(model_dir: str, prompts: list[list[int]], outs: list[int], temp: float) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(do_sample=temp > 0, temperature=temp if temp > 0 else None, top_p=None, top_k=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:8], attention_mask=mask[:8], max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs), **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--overlap-off", action="store_true", help="also run with the overlap loop off")
    ap.add_argument("--config", default="qwen3-0.6b", help="an architecture of benchmarks/configs")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--variant", action="append", type=json.loads, default=None,
                    help="engine options as JSON (repeatable): each workload runs once per variant, in turn")
    a = ap.parse_args()
    model_dir = dummy_model_dir(a.config)
    par = {k: v for k, v in (("tp_size", a.tp_size), ("dp_size", a.dp_size)) if v > 1}
    rows: list[dict[str, object]] = []
    for name in a.workloads.split(","):
        prompts, outs, temp = workload(name, a.requests)
        tokens = sum(outs)
        times = []
        for variant in a.variant or [{}]:
            times.append(run_sgl(model_dir, prompts, outs, temp, **par, **variant))
            label = json.dumps(variant, separators=(",", ":")) if variant else ""
            rows.append({"workload": name, "engine": f"sgl {a.config} tp{a.tp_size} dp{a.dp_size} {label}".strip(),
                         "seconds": times[-1], "tok/s": tokens / times[-1],
                         "of W1 floor": f"{tokens / times[-1] / FLOOR_W1_TOK_S:.0%}"})
            if a.no_hf:
                print(f"RESULT name={name} sgl_tok_s={tokens / times[-1]:.0f} {label}".strip())
        t = times[0]
        if a.overlap_off:
            t2 = run_sgl(model_dir, prompts, outs, temp, disable_overlap_schedule=True, **par)
            rows.append({"workload": name, "engine": "sgl no-overlap", "seconds": t2, "tok/s": tokens / t2,
                         "of W1 floor": f"{tokens / t2 / FLOOR_W1_TOK_S:.0%}"})
        if not a.no_hf:
            th = run_hf(model_dir, prompts, outs, temp)
            rows.append({"workload": name, "engine": "hf generate", "seconds": th, "tok/s": tokens / th,
                         "of W1 floor": f"{tokens / th / FLOOR_W1_TOK_S:.0%}"})
            print(f"RESULT name={name} sgl_tok_s={tokens / t:.0f} hf_tok_s={tokens / th:.0f} ratio={th / t:.2f}")
    print(f"on {machine()}, torch {torch.__version__}")
    print(table(rows))


if __name__ == "__main__":
    main()
