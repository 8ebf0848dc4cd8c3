"""The profiles' kernel kinds (benchmarks/kernel_kinds.py) and the vLLM profile's trace
reading (benchmarks/vllm_profile.py), on names both engines' kernels carry and on a
Chrome trace written here."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from benchmarks.kernel_kinds import by_kind, kind_of, result_fields, top_rows
from benchmarks.vllm_profile import trace_kernels, written_traces


@pytest.mark.parametrize(("name", "kind"), [
    # sgl: FlashInfer, its own Triton kernels, cuBLAS
    ("flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "decode attention"),
    ("partial", "decode attention"),
    ("flashinfer::BatchPrefillWithRaggedKVCacheKernel<...>", "prefill attention"),
    ("norm_rope_store_kernel", "norm, rotary, kv write"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    # vLLM: FlashAttention 3, its custom ops, torch.compile's fusions
    ("void flash::prepare_varlen_num_blocks_kernel(int, int, int, int const*)", "attention, prefill and decode"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>", "attention, "
     "prefill and decode"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, ...>", "kv write"),
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>", "norm"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>", "activation"),
    ("triton_poi_fused_mul_silu_slice_1", "activation"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "rotary"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("some_unknown_kernel", "other"),
])
def test_a_kernel_s_kind_comes_from_its_name(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_kinds_and_top_kernels_sum_and_rank_by_time() -> None:
    kernels = {"nvjet_a": (3.0, 30), "nvjet_b": (1.0, 10), "partial": (2.0, 100), "odd": (0.5, 1)}
    assert by_kind(kernels) == {"gemm": 4.0, "decode attention": 2.0, "other": 0.5}
    assert [r["kernel"] for r in top_rows(kernels, 2)] == ["nvjet_a", "partial"]
    assert top_rows(kernels, 1)[0]["us each"] == pytest.approx(1e5)
    assert result_fields(kernels) == "kernel_s=6.500 gemm_s=4.000 decode_attention_s=2.000 other_s=0.500"


def test_a_trace_s_gpu_events_are_summed_by_name(tmp_path: Path) -> None:
    """GPU kernels, copies and memsets (complete events, microseconds) count; the CPU side
    and other phases do not; plain and gzipped traces read alike."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_a", "dur": 120.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_a", "dur": 80.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "dur": 5.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0},
        {"ph": "i", "cat": "kernel", "name": "nvjet_a", "dur": 999.0},
    ]
    with gzip.open(tmp_path / "worker.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    (tmp_path / "other.pt.trace.json").write_text(json.dumps({"traceEvents": events[:1]}))
    paths = written_traces(tmp_path, timeout=10, poll=0.05)
    assert [p.name for p in paths] == ["other.pt.trace.json", "worker.pt.trace.json.gz"]
    got = trace_kernels(paths)
    assert got == {"nvjet_a": (pytest.approx(320e-6), 3), "Memcpy HtoD (Pinned -> Device)": (pytest.approx(5e-6), 1)}
    empty = tmp_path / "none"
    empty.mkdir()
    assert written_traces(empty, timeout=0.2, poll=0.05) == []


def test_the_profiler_is_turned_on_the_way_the_engine_takes_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM with a ProfilerConfig gets one (only the fields it has); one whose LLM refuses
    the argument, or that has no such config, gets the environment variable instead."""
    import dataclasses
    import sys
    import types

    from benchmarks.vllm_profile import start_profiled

    @dataclasses.dataclass
    class ProfilerConfig:
        profiler: str | None = None
        torch_profiler_dir: str = ""
        torch_profiler_with_stack: bool = True

    class LLM:
        def __init__(self, **kw: object) -> None:
            self.kw = kw

    class OldLLM:
        def __init__(self, model: str, **kw: object) -> None:
            if kw:
                raise TypeError(f"unexpected keyword argument {next(iter(kw))!r}")
            self.kw = {"model": model}

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    config_mod = types.ModuleType("vllm.config")
    config_mod.ProfilerConfig = ProfilerConfig  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", config_mod)
    llm = start_profiled(LLM, {"model": "m"}, tmp_path)
    assert llm.kw == {"model": "m", "profiler_config": ProfilerConfig("torch", str(tmp_path), False)}
    assert "VLLM_TORCH_PROFILER_DIR" not in os.environ
    assert start_profiled(OldLLM, {"model": "m"}, tmp_path).kw == {"model": "m"}
    assert os.environ["VLLM_TORCH_PROFILER_DIR"] == str(tmp_path)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    monkeypatch.setitem(sys.modules, "vllm.config", None)  # no such module: ImportError
    assert start_profiled(LLM, {"model": "m"}, tmp_path).kw == {"model": "m"}
    assert os.environ["VLLM_TORCH_PROFILER_DIR"] == str(tmp_path)
