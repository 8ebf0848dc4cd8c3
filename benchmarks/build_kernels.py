"""Build every FlashInfer kernel module the engine and the GPU tests load, in one
parallel ninja run (on the H200's 16 cores a few minutes, against ~6 minutes for the
same modules built one after another on first use). Modules already installed as AOT
(benchmarks/gpu/run.sh installs a brought-along kernel cache that way) are skipped, so
with a warm cache this does nothing.

    python -m benchmarks.build_kernels      # step `jit` of benchmarks/gpu/run.sh
"""

from __future__ import annotations

import time

import torch


def specs() -> list:
    from flashinfer import jit
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.sampling import gen_sampling_module

    bf16, fp8, i32 = torch.bfloat16, torch.float8_e4m3fn, torch.int32
    out = [gen_norm_module(), gen_rope_module(), jit.gen_act_and_mul_module("silu"), gen_sampling_module(),
           gen_cascade_module()]
    for d in (128, 64):  # Qwen3-0.6B's head_dim; the GPU tests' tiny Qwen3
        out.append(jit.gen_batch_decode_module(bf16, bf16, bf16, i32, d, d, 0, False, False))
        for backend in ("fa2", "fa3"):  # paged prefill runs fa2; ragged prefill picks fa3 on an H200
            out.append(jit.gen_batch_prefill_module(backend, bf16, bf16, bf16, i32, d, d, 0, False, False, False))
        # kv_cache_dtype="fp8_e4m3": decode and the paged prefill (prefix, cascade, tensor-core
        # decode) read the FP8 pool; the ragged prefill still reads bf16 K/V.
        out.append(jit.gen_batch_decode_module(bf16, fp8, bf16, i32, d, d, 0, False, False))
        out.append(jit.gen_batch_prefill_module("fa2", bf16, fp8, bf16, i32, d, d, 0, False, False, False))
    return out


def main() -> None:
    from flashinfer.jit import build_jit_specs

    todo = specs()
    missing = [s.name for s in todo if not s.aot_path.exists() and not s.is_compiled]
    print(f"{len(todo)} modules, {len(missing)} not built: {missing}", flush=True)
    t0 = time.perf_counter()
    build_jit_specs(todo, verbose=False)
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
