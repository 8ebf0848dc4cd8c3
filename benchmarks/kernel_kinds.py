"""GPU kernels grouped by what they do, for the profiles of both engines (sgl's
benchmarks/profile_run.py, vLLM's benchmarks/vllm_profile.py): a kernel's kind from its
name, and the tables of time by kind and of the costliest kernels.

The names are the kernels' own: FlashInfer's and sgl's Triton kernels, cuBLAS's and
CUTLASS's GEMMs, vLLM's custom ops and FlashAttention, and the Triton kernels
torch.compile generates (`triton_poi_fused_...`, `triton_red_fused_...`, named after the
ops they fuse). FlashAttention runs prefill and decode rows in one kernel, so vLLM's
attention is one kind where sgl's is two."""

from __future__ import annotations

# (kind, substrings of a kernel's name, lower case), first match wins.
KINDS = [
    # sgl's Triton kernels by their function names (kernels/triton_decode.py, norm_rope_store.py)
    ("decode attention", ("batchdecode", "mergestate", "merge_state", "variablelengthmerge", "partial", "merge")),
    ("norm, rotary, kv write", ("norm_rope_store",)),
    ("prefill attention", ("batchprefill", "prefillwith", "ragged")),
    ("attention, prefill and decode", ("flash_fwd", "flashattn", "flash::", "fmha", "unified_attention")),
    ("sampling", ("sampling", "topk", "top_k", "softmax", "argmax", "gumbel", "exponential", "multinomial")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "cublas", "splitk")),
    ("norm", ("rmsnorm", "rms_norm", "norm", "rsqrt")),
    ("rotary", ("rope", "rotary")),
    ("activation", ("act_and_mul", "silu", "gelu")),
    ("kv write", ("kv_write", "_write_kv", "reshape_and_cache", "index_put", "scatter")),
    ("copy", ("memcpy", "memset", "copy", "fill")),
    ("gather/index", ("index", "gather", "take")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def by_kind(kernels: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Seconds by kind, largest first; `kernels`: name -> (GPU seconds, calls)."""
    out: dict[str, float] = {}
    for name, (s, _) in kernels.items():
        k = kind_of(name)
        out[k] = out.get(k, 0.0) + s
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def kind_rows(kernels: dict[str, tuple[float, int]]) -> list[dict[str, object]]:
    total = sum(s for s, _ in kernels.values()) or 1.0
    return [{"kind": k, "GPU s": s, "share %": 100 * s / total} for k, s in by_kind(kernels).items()]


def top_rows(kernels: dict[str, tuple[float, int]], top: int) -> list[dict[str, object]]:
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"kernel": n[:90], "kind": kind_of(n), "calls": int(c), "GPU s": s, "us each": 1e6 * s / max(c, 1)}
            for n, (s, c) in ranked]


def result_fields(kernels: dict[str, tuple[float, int]]) -> str:
    """`kernel_s=... <kind>_s=...` for a RESULT line (kinds as single words)."""
    kinds = " ".join(f"{k.replace(', ', '_').replace(' ', '_').replace('/', '_')}_s={s:.3f}"
                     for k, s in by_kind(kernels).items())
    return f"kernel_s={sum(s for s, _ in kernels.values()):.3f} {kinds}"
