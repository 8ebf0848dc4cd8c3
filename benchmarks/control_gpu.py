"""The control plane on a GPU: memory release and resume, and weight updates from a
trainer process's CUDA tensors (Qwen3 architectures, dummy bf16 weights).

1. Free GPU memory as another process sees it (torch.cuda.mem_get_info in a fresh
   process): before the engine, with it, after release_memory_occupation() (weights
   and KV) and after resume; the share of the engine's memory released.
2. W1 (BENCHMARKS.md, --requests of them) before the release and after the resume.
3. update_weights_from_tensor: a trainer process makes the model's every tensor on the
   GPU, shares them through one CUDA IPC buffer (sgl.weights.share_tensors), and the
   engine copies them in; seconds and GB/s, twice (the first opens the IPC handle).
   The values read back (get_weights_by_name) equal the trainer's, and a greedy batch
   run twice gives the same tokens (CUDA graphs read the new weights in place).

    python -m benchmarks.control_gpu [--config qwen3-8b] [--requests 256] [--mem-fraction 0.6]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import time
from typing import Any

import torch

import sgl
from benchmarks.common import dummy_model_dir, machine, random_prompts, table

PROBE = "import torch; f, t = torch.cuda.mem_get_info(); print(f)"


def free_bytes() -> int:
    """Free GPU memory as a fresh process sees it."""
    return int(subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, text=True).stdout)


def trainer(model_dir: str, seed: int, conn: Any) -> None:
    """Every tensor of the model, random bf16 on the GPU, shared in one CUDA IPC buffer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sgl.weights import share_tensors

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(cfg).named_parameters()}
    g = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {n: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02 for n, s in shapes.items()}
    for n in tensors:
        if n.endswith("norm.weight"):
            tensors[n].fill_(1.0)
    probe = "model.layers.0.self_attn.q_proj.weight"
    with share_tensors(tensors) as buf:
        conn.send((buf.spec, tensors[probe].flatten()[:16].float().tolist(), probe))
        conn.recv()


def w1(e: sgl.Engine, n: int) -> float:
    prompts = random_prompts(n, 512, 151000)
    params = {"temperature": 0.0, "max_new_tokens": 512, "ignore_eos": True}
    e.generate(input_ids=prompts[:8], sampling_params=params)
    e.flush_cache()
    t0 = time.perf_counter()
    e.generate(input_ids=prompts, sampling_params=params)
    return n * 512 / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--mem-fraction", type=float, default=None, help="mem_fraction_static (room for the trainer)")
    a = ap.parse_args()
    model_dir = dummy_model_dir(a.config)
    rows: list[dict[str, object]] = []  # memory
    updates: list[dict[str, object]] = []
    gib = 2**30
    kw = {} if a.mem_fraction is None else {"mem_fraction_static": a.mem_fraction}
    free0 = free_bytes()
    with sgl.Engine(model_dir, transport="ipc", load_format="dummy", skip_tokenizer_init=True, random_seed=0,
                    **kw) as e:
        free1 = free_bytes()
        used = free0 - free1
        before = w1(e, a.requests)
        t0 = time.perf_counter()
        e.release_memory_occupation()
        release_s = time.perf_counter() - t0
        free2 = free_bytes()
        t0 = time.perf_counter()
        e.resume_memory_occupation()
        resume_s = time.perf_counter() - t0
        free3 = free_bytes()
        after = w1(e, a.requests)
        info = e.get_server_info()
        rows.append({"config": a.config, "engine GiB": used / gib, "released GiB": (free2 - free1) / gib,
                     "released share": f"{(free2 - free1) / used:.1%}", "back after resume GiB": (free2 - free3) / gib,
                     "release s": release_s, "resume s": resume_s, "W1 before tok/s": before,
                     "W1 after tok/s": after})
        print("memory stats:", info.get("memory"), "released:", info.get("memory_released"), flush=True)

        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=trainer, args=(model_dir, 1, there), daemon=True)
        proc.start()
        spec, values, probe = here.recv()
        nbytes = spec.nbytes
        prompts = random_prompts(8, 64, 151000)
        greedy = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
        for i in range(2):
            t0 = time.perf_counter()
            out = e.update_weights_from_tensor(spec, weight_version=f"push-{i}")
            dt = time.perf_counter() - t0
            updates.append({"config": a.config, "update": f"from tensor #{i + 1}", "GB": nbytes / 1e9, "seconds": dt,
                         "GB/s": nbytes / 1e9 / dt, "engine's copy s": out.get("seconds")})
        got = e.get_weights_by_name(probe, truncate_size=16)
        ok = max(abs(x - y) for x, y in zip(got, values)) < 1e-2
        first = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=greedy)]
        second = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=greedy)]
        here.send("done")
        proc.join(60)
        print(f"RESULT control config={a.config} released_share={(free2 - free1) / used:.3f} "
              f"w1_before={before:.0f} w1_after={after:.0f} values_match={ok} greedy_repeatable={first == second}",
              flush=True)
    print(f"on {machine()}, torch {torch.__version__}")
    print(table(rows))
    print(table(updates))


if __name__ == "__main__":
    main()
