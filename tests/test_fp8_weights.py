"""FP8 weights (`quantization="fp8"`, sgl.kernels.fp8_linear), on the CPU, where torch runs
the same scaled GEMM a GPU does: the product equals the dequantized operands' product and
stays within FP8's rounding of the exact one; an engine's projection weights are the
checkpoint's quantized per output row (fused q/k/v and gate/up too) at start-up and after
an update, and survive a memory release; LoRA adapters add to the FP8 product; on the
default model's real weights its greedy predictions mostly agree with float32's; and the
settings that cannot hold are refused by name. The GPU run (CUDA graphs, bf16) is in test_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import sgl
from benchmarks.kv_dtype_accuracy import PROMPTS, top1_along
from sgl.kernels.fp8_linear import FP8, fp8_linear, quantize_rows, quantize_rows_torch, weight_only_linear
from tests.conftest import assert_kv_balanced, tiny_model_dir

VOCAB = 512
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
IDS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_rows(t)
    return q.float() * scale


@settings(max_examples=80, deadline=None)
@given(m=st.integers(0, 9), k=st.integers(1, 80), n=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
       zero_row=st.booleans(), seed=st.integers(0, 2**31))
def test_the_product_is_the_dequantized_product(m: int, k: int, n: int, dtype: torch.dtype, magnitude: float,
                                                zero_row: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * magnitude).to(dtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different scales
    if zero_row and m:
        x[0] = 0
    qw, sw = quantize_rows(w)
    assert qw.dtype == FP8
    y = fp8_linear(x, qw, sw.view(-1), dtype)
    assert y.shape == (m, n) and y.dtype == dtype
    if m == 0:
        return
    qx, sx = quantize_rows(x)
    dequantized = (qx.double() * sx.double()) @ (qw.double() * sw.double()).T
    mass = x.double().abs() @ w.double().abs().T  # sum |x||w|: what every rounding is relative to
    out_eps = 2**-8 if dtype == torch.bfloat16 else 1e-6
    assert ((y.double() - dequantized).abs() <= out_eps * mass + 1e-30).all()
    # e4m3 rounds to 3 mantissa bits: each operand within 1/16 of itself (plus the subnormal
    # step, 2^-9 of its row's scale), so each product term within about 13%.
    floor = k * 2**-9 * (sx.double() @ sw.double().T) * (448 * 2)
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).abs() <= (0.13 + out_eps) * mass + floor + 1e-30).all()
    if zero_row:
        assert not y[0].any()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    base = tmp_path_factory.mktemp("fp8")
    return {seed: tiny_model_dir(base, "qwen3", VOCAB, seed=seed) for seed in (0, 1)}


def _engine(path: str, **kw: Any) -> sgl.Engine:
    return sgl.Engine(path, transport="inproc", skip_tokenizer_init=True, dtype="float32", random_seed=0,
                      max_total_tokens=512, max_running_requests=4, **kw)


def _assert_weights_are_quantized(engine: sgl.Engine, checkpoint: str) -> None:
    tensors = load_file(str(Path(checkpoint) / "model.safetensors"))
    for layer in (0, 1):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}.weight"
            want = _dequantized(tensors[name])
            got = torch.tensor(engine.get_weights_by_name(name, truncate_size=want.numel()))
            assert torch.equal(got, want.flatten()), name
    norm = "model.layers.0.input_layernorm.weight"  # left in the model's dtype
    assert engine.get_weights_by_name(norm, truncate_size=64) == tensors[norm].tolist()


def test_weights_are_the_checkpoints_quantized_and_an_update_quantizes_too(checkpoints: dict[int, str]) -> None:
    """At start-up and after update_weights_from_disk the projections hold the checkpoint's
    rows quantized one by one; the updated engine generates what a fresh FP8 engine of the
    new checkpoint does, also after its weights were released and resumed."""
    with _engine(checkpoints[1], quantization="fp8") as fresh:
        want = [o["output_ids"] for o in fresh.generate(input_ids=IDS, sampling_params=GREEDY)]
    with _engine(checkpoints[0], quantization="fp8") as e:
        _assert_weights_are_quantized(e, checkpoints[0])
        before = [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)]
        e.update_weights_from_disk(checkpoints[1])
        _assert_weights_are_quantized(e, checkpoints[1])
        assert [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)] == want != before
        e.release_memory_occupation(["weights"])
        e.resume_memory_occupation(["weights"])
        assert [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)] == want
        assert e.get_server_info()["quantization"] == "fp8"
        assert_kv_balanced(e.get_server_info())


def test_tensor_parallel_ranks_quantize_their_own_parts(checkpoints: dict[int, str]) -> None:
    """Under tp_size=2 a column-parallel projection's rows are split, so each row keeps the
    scale it has unsplit; a row-parallel one (o, down) splits every row, and each rank
    scales its half by its own maximum: both read back as those quantized parts."""
    tensors = load_file(str(Path(checkpoints[0]) / "model.safetensors"))
    with sgl.Engine(checkpoints[0], transport="ipc", skip_tokenizer_init=True, dtype="float32", tp_size=2,
                    max_total_tokens=512, quantization="fp8") as e:
        for proj in PROJECTIONS:
            name = f"model.layers.1.{proj}.weight"
            full = tensors[name]
            want = (_dequantized(full) if proj not in ("self_attn.o_proj", "mlp.down_proj")
                    else torch.cat([_dequantized(half) for half in full.chunk(2, dim=1)], dim=1))
            got = torch.tensor(e.get_weights_by_name(name, truncate_size=full.numel()))
            assert torch.equal(got, want.flatten()), name
        assert len(e.generate(input_ids=IDS, sampling_params=GREEDY)[0]["output_ids"]) == GREEDY["max_new_tokens"]
        assert_kv_balanced(e.get_server_info())


def test_lora_adapters_run_on_fp8_projections(checkpoints: dict[int, str], tmp_path: Path) -> None:
    """An adapter's delta is added to the FP8 product: requests without one generate what
    the FP8 engine without LoRA does, and requests with one generate something else."""
    from tests.test_lora import SPECS, make_adapter

    adapter = make_adapter(checkpoints[0], tmp_path / "all8", *SPECS["all8"], seed=3)
    with _engine(checkpoints[0], quantization="fp8") as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=IDS, sampling_params=GREEDY)]
    with _engine(checkpoints[0], quantization="fp8", lora_paths=[f"all8={adapter}"]) as e:
        outs = e.generate(input_ids=IDS * 2, sampling_params=GREEDY, lora_path=[None, None, "all8", "all8"])
        got = [o["output_ids"] for o in outs]
        assert got[:2] == want
        assert got[2] != want[0] and got[3] != want[1]
        assert_kv_balanced(e.get_server_info())


def test_greedy_predictions_agree_with_float32_on_the_default_model() -> None:
    """SmolLM2-135M, real weights, float32 activations: along float32's greedy continuations
    (48 tokens of four prompts) the FP8 model's top prediction is the same token at 85% of
    the positions or more (89.6% measured; bfloat16 compute against float32 gives 98%)."""
    prompts = PROMPTS[:4]
    with sgl.Engine(transport="inproc", dtype="float32", max_total_tokens=2048) as e:
        outs = e.generate(prompts, {**GREEDY, "max_new_tokens": 48})
    with sgl.Engine(transport="inproc", dtype="float32", max_total_tokens=2048, quantization="fp8") as e:
        share = top1_along(e, prompts, outs)
        assert_kv_balanced(e.get_server_info())
    assert share >= 0.85, share


def test_settings_that_cannot_hold_are_refused_by_name(null_model_dir: str) -> None:
    with pytest.raises(ValueError, match="quantization='fp8'.*null model"):
        sgl.Engine(null_model_dir, transport="inproc", load_format="null", quantization="fp8")
    with pytest.raises(ValueError, match="quantization"):
        sgl.Engine(null_model_dir, transport="inproc", load_format="null", quantization="int4")


# ---- on a GPU (marked gpu; skipped without CUDA) ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 256, 512), (7, 1024, 3072), (300, 512, 256)])
def test_gpu_product_is_the_dequantized_product(m: int, k: int, n: int, out_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g).to(out_dtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    qw, sw = quantize_rows(w.cuda())
    y = fp8_linear(x.cuda(), qw, sw.view(-1), out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n)
    qx, sx = quantize_rows(x)
    assert torch.equal(qx.view(torch.uint8), quantize_rows(x.cuda())[0].cpu().view(torch.uint8))
    dequantized = (qx.double() * sx.double()) @ (qw.cpu().double() * sw.cpu().double()).T
    mass = x.double().abs() @ w.double().abs().T
    assert ((y.cpu().double() - dequantized).abs() <= 2**-7 * mass).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("m,k,n", [(1, 256, 512), (7, 1000, 3072), (64, 4096, 96), (33, 12288, 4096)])
def test_gpu_weight_only_product_is_the_dequantized_product(m: int, k: int, n: int, dtype: torch.dtype,
                                                            split_k: int) -> None:
    """FP8 weights widened in the kernel against x times the dequantized weight in float64:
    within the output's rounding and float32 accumulation, whole or with K split."""
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    qw, sw = quantize_rows(w.cuda())
    y = weight_only_linear(x.cuda(), qw, sw, split_k=split_k)
    assert y.dtype == dtype and y.shape == (m, n)
    want = x.double() @ (qw.cpu().double() * sw.cpu().double()).T
    mass = x.double().abs() @ w.double().abs().T
    assert ((y.cpu().double() - want).abs() <= 2**-7 * mass + 1e-6).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 1), (3, 100), (64, 4096), (5, 12288), (300, 1000), (2, 5000)])
def test_gpu_triton_quantization_is_the_torch_definition(m: int, k: int, dtype: torch.dtype) -> None:
    """The one-launch kernel gives the torch ops' bits: the scales and every FP8 byte, for
    rows shorter and longer than its block, zero rows, subnormal and out-of-range values."""
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 4, m)[:, None]
    x[0, 0] = 1e30 if dtype == torch.float32 else 6e4
    if m > 2:
        x[1] = 0
    x = x.to(dtype).cuda()
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_torch(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(q_ref.cpu().view(torch.uint8), quantize_rows_torch(x.cpu())[0].view(torch.uint8))


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("fp8-gpu"), "qwen3", vocab=2048, hidden_size=256,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                          intermediate_size=512)


def _gpu_greedy(path: str, **kw: Any) -> list[list[int]]:
    prompts = [[(37 * i + 11 * j) % 2000 + 1 for j in range(3 + 17 * i)] for i in range(5)]
    with sgl.Engine(path, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16", quantization="fp8",
                    max_total_tokens=20000, **kw) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 24,
                                                              "ignore_eos": True})
        assert e.get_server_info()["quantization"] == "fp8"
        assert_kv_balanced(e.get_server_info())
    return [o["output_ids"] for o in outs]


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp8_cuda_graphs_equal_eager(gpu_model_dir: str) -> None:
    """FP8 projections under CUDA graphs (decode and piecewise prefill) replay what the
    eager forward computes, token for token."""
    assert _gpu_greedy(gpu_model_dir, cuda_graph_max_bs=8) == _gpu_greedy(gpu_model_dir, disable_cuda_graph=True)


# ---- checkpoints stored in FP8 (sgl.sched.models.fp8_checkpoint) ----

def _fp8_checkpoint(src: str, out: Path, block: tuple[int, int] | None, drop: str | None = None) -> tuple[str, str]:
    """`src` with its projections stored in FP8, as Qwen's releases (a scale per block) or
    AutoFP8's (one per tensor, and a static input scale) store them, in out/fp8; and in
    out/plain a float32 twin holding the values those FP8 weights stand for. `drop`: a
    tensor left out of the FP8 one."""
    tensors = load_file(str(Path(src) / "model.safetensors"))
    config = json.loads((Path(src) / "config.json").read_text())
    stored: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".layers." not in name or not name.endswith("proj.weight"):
            stored[name] = plain[name] = t
            continue
        if block is None:
            scale = t.abs().max() / 448
            stored[name + "_scale"], stored[name.replace(".weight", ".input_scale")] = scale, torch.tensor(0.5)
            full = scale
        else:
            bn, bk = block
            n, k = t.shape
            scale = torch.zeros(-(-n // bn), -(-k // bk))
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    scale[i, j] = t[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448
            stored[name + "_scale_inv"] = scale
            full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        stored[name] = (t / full).clamp(-448, 448).to(FP8)
        plain[name] = stored[name].float() * full
    dirs = {}
    for kind, values in (("fp8", stored), ("plain", plain)):
        d = out / kind
        d.mkdir(parents=True)
        cfg = dict(config)
        if kind == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          **({"weight_block_size": list(block)} if block else {})}
        (d / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in values.items() if k != drop}, str(d / "model.safetensors"))
        dirs[kind] = str(d)
    return dirs["fp8"], dirs["plain"]


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("block", [(48, 32), None], ids=["blocks", "per-tensor"])
def test_an_fp8_checkpoint_runs_as_the_model_its_values_make(checkpoints: dict[int, str], tmp_path: Path,
                                                             block: tuple[int, int] | None,
                                                             quantization: str | None) -> None:
    """A checkpoint stored in FP8 (scales per block, partial blocks included, or per
    tensor) is the model that a float32 checkpoint of the same values gives: the same
    weights and the same tokens, in float32 (a CPU's default: its FP8 GEMM is slow) and
    with quantization="fp8" (a GPU's default for such a checkpoint, test_gpu_fp8_checkpoint)."""
    fp8_dir, plain_dir = _fp8_checkpoint(checkpoints[0], tmp_path, block)
    name = "model.layers.1.self_attn.k_proj.weight"
    with _engine(plain_dir, quantization=quantization) as e:
        want = [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)]
        weights = e.get_weights_by_name(name, truncate_size=4096)
    with _engine(fp8_dir, quantization=quantization) as e:
        assert e.get_server_info()["quantization"] == quantization
        assert e.get_weights_by_name(name, truncate_size=4096) == weights
        assert [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)] == want


def test_updates_from_fp8_checkpoints_and_a_broken_one(checkpoints: dict[int, str], tmp_path: Path) -> None:
    """update_weights_from_disk reads an FP8 checkpoint as start-up does; one whose weight
    lost its scale is refused by that weight's name before anything is copied."""
    fp8_dir, _ = _fp8_checkpoint(checkpoints[1], tmp_path / "good", (32, 32))
    broken, _ = _fp8_checkpoint(checkpoints[1], tmp_path / "broken", (32, 32),
                                drop="model.layers.0.mlp.down_proj.weight_scale_inv")
    with _engine(fp8_dir, quantization="fp8") as fresh:
        want = [o["output_ids"] for o in fresh.generate(input_ids=IDS, sampling_params=GREEDY)]
    with _engine(checkpoints[0], quantization="fp8") as e:
        e.update_weights_from_disk(fp8_dir)
        assert [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)] == want
        with pytest.raises(ValueError, match=r"without a scale.*layers\.0\.mlp\.down_proj\.weight"):
            e.update_weights_from_disk(broken)
        assert [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)] == want


def test_a_scale_before_its_weight_and_other_quantizations() -> None:
    """The stream pairs a weight with its scale whichever comes first; a checkpoint
    quantized another way is refused by its quant_method."""
    from types import SimpleNamespace

    from sgl.sched.models.fp8_checkpoint import Fp8Checkpoint

    q = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(FP8)
    scale = torch.tensor([[2.0]])
    ck = Fp8Checkpoint((2, 2))
    first = dict(ck.dequantized([("a.weight_scale_inv", scale), ("a.weight", q), ("b", torch.ones(1))]))
    assert torch.equal(first["a.weight"], q.float() * 2) and set(first) == {"a.weight", "b"}
    with pytest.raises(ValueError, match="quant_method='awq'"):
        Fp8Checkpoint.of(SimpleNamespace(quantization_config={"quant_method": "awq"}))
    assert Fp8Checkpoint.of(SimpleNamespace()) is None


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp8_checkpoint_runs_with_fp8_weights_unasked(gpu_model_dir: str, tmp_path: Path) -> None:
    """On a GPU that runs FP8 GEMMs a checkpoint stored in FP8 starts with FP8 weights, and
    generates what its float32 twin does with quantization="fp8"."""
    fp8_dir, plain_dir = _fp8_checkpoint(gpu_model_dir, tmp_path, (128, 128))
    with sgl.Engine(fp8_dir, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16",
                    max_total_tokens=4096) as e:
        assert e.get_server_info()["quantization"] == "fp8"
        got = [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)]
    with sgl.Engine(plain_dir, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16",
                    max_total_tokens=4096, quantization="fp8") as e:
        assert [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)] == got


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp8_checkpoint_of_shapes_fp8_gemms_refuse_runs_in_the_models_dtype(tmp_path: Path) -> None:
    """An FP8 checkpoint whose projections are not in multiples of 16 (intermediate size
    40: FP8 GEMMs refuse it) starts unasked in the model's dtype, as its float32 twin does;
    asked for FP8, the engine refuses by name."""
    src = tiny_model_dir(tmp_path / "src", "qwen3", vocab=2048, hidden_size=256, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, intermediate_size=40)
    fp8_dir, plain_dir = _fp8_checkpoint(src, tmp_path, (128, 128))
    kw: dict[str, Any] = {"transport": "inproc", "skip_tokenizer_init": True, "dtype": "bfloat16",
                          "max_total_tokens": 4096}
    with sgl.Engine(fp8_dir, **kw) as e:
        assert e.get_server_info()["quantization"] is None
        got = [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)]
    with sgl.Engine(plain_dir, **kw) as e:
        assert [o["output_ids"] for o in e.generate(input_ids=IDS, sampling_params=GREEDY)] == got
    with pytest.raises(Exception, match="multiples of 16"):
        sgl.Engine(fp8_dir, quantization="fp8", **kw)
