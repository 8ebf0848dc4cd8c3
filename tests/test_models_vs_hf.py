"""sgl's model code and HF-directory loader against Hugging Face transformers:
greedy generation must match token for token (float32, CPU) for every supported
architecture, with prompts of different lengths prefilled together (ragged,
packed) and decoded together over the paged KV, including a prefix-cached
extend. Also the loader's error messages."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch
from paged_driver import PagedDriver, converted_default_model
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from sgl.sched.models.loader import load_model

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [11, 2], [64, 65, 66, 67, 1, 0, 120, 33, 12, 9, 100, 4, 50], [7]]
NEW = 8

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

CASES = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=10000.0),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0),
    "llama3-rope": dict(
        model_type="llama",
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "llama-linear-rope": dict(
        model_type="llama", tie_word_embeddings=False, rope_scaling=dict(rope_type="linear", factor=2.0)
    ),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=32),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF inits biases to zero and norms to one, which would hide mapping bugs;
    give every parameter distinct random values with a healthy logit spread."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def make_hf_dir(tmp_path: Path, case: str, **save_kw: object) -> tuple[torch.nn.Module, Path]:
    kw = dict(TINY) | CASES[case]
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(hf, seed=1)
    out = tmp_path / case
    hf.save_pretrained(out, **save_kw)
    return hf, out


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_batched(tmp_path: Path, case: str) -> None:
    save_kw = {"max_shard_size": "60KB"} if case == "qwen2" else {}
    hf, path = make_hf_dir(tmp_path, case, **save_kw)
    if case == "qwen2":
        assert (path / "model.safetensors.index.json").is_file()
    model, config = load_model(str(path), "auto", torch.float32, CPU)
    assert config.architectures == [type(hf).__name__]
    assert model.tie_word_embeddings == CASES[case]["tie_word_embeddings"]
    assert model.head_dim == CASES[case].get("head_dim", 16)

    drv = PagedDriver(model)
    rows = [drv.new_request() for _ in PROMPTS]
    ours = drv.generate(rows, PROMPTS, NEW)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        assert got == hf_greedy(hf, prompt, NEW), f"{case}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_prefix_cached_extend_matches_hf(tmp_path: Path, case: str) -> None:
    hf, path = make_hf_dir(tmp_path, case)
    model, _ = load_model(str(path), "auto", torch.float32, CPU)
    drv = PagedDriver(model)
    base = PROMPTS[2]
    first = drv.new_request()
    drv.extend([first], [base])
    # Two requests share the first one's 10-token prefix KV and compute only their tails
    # (qo_len < kv_len), batched with a fresh request that computes everything.
    tails = [[3, 3, 90], [101]]
    shared = [drv.new_request(shared_prefix_of=first, prefix_len=10) for _ in tails]
    fresh_prompt = PROMPTS[0]
    fresh = drv.new_request()
    ours = drv.generate([*shared, fresh], [*tails, fresh_prompt], NEW)
    expected = [hf_greedy(hf, base[:10] + t, NEW) for t in tails] + [hf_greedy(hf, fresh_prompt, NEW)]
    assert ours == expected


def test_dummy_weights_are_seeded(tmp_path: Path) -> None:
    _, path = make_hf_dir(tmp_path, "qwen3")
    a, _ = load_model(str(path), "dummy", torch.float32, CPU, seed=3)
    b, _ = load_model(str(path), "dummy", torch.float32, CPU, seed=3)
    c, _ = load_model(str(path), "dummy", torch.float32, CPU, seed=4)
    wa, wb, wc = (m.model.layers[0].self_attn.qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert abs(wa.std().item() - 0.02) < 0.005
    drv = PagedDriver(a)
    assert drv.extend([drv.new_request()], [[1, 2, 3]]).shape == (1, 128)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1})
    )
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(tmp_path), "auto", torch.float32, CPU)


def test_missing_and_unexpected_weights(tmp_path: Path) -> None:
    _, path = make_hf_dir(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    dropped = dict(tensors)
    del dropped["model.layers.1.self_attn.k_proj.weight"]
    save_file(dropped, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(path), "auto", torch.float32, CPU)
    extra = dict(tensors) | {"model.layers.0.self_attn.rogue.weight": torch.zeros(2)}
    save_file(extra, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.rogue\.weight"):
        load_model(str(path), "auto", torch.float32, CPU)


def test_path_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json.*Hugging Face model directory or a .gguf file"):
        load_model(str(tmp_path), "auto", torch.float32, CPU)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model(str(tmp_path / "nope"), "auto", torch.float32, CPU)
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tmp_path), "pickle", torch.float32, CPU)


@pytest.fixture(scope="module")
def smollm2_dir(request: pytest.FixtureRequest) -> str:
    # pytest's cache directory persists across runs, so the conversion happens once per checkout.
    return converted_default_model(str(request.config.cache.mkdir("sgl-default-model")))


def hf_agrees_greedy(hf: torch.nn.Module, prompt: list[int], generated: list[int]) -> list[int]:
    """HF's greedy choice after each prefix of prompt + generated, from one full
    forward: equal to `generated` exactly when HF's greedy decode yields it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(generated) - 1].argmax(-1).tolist()


@pytest.mark.slow  # 15-75 s on two shared CPU cores
def test_default_smollm2_matches_hf(smollm2_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["What is the capital of France?", "Hi", "Write a haiku about the sea and the moon, please."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
        for t in texts
    ] + [tok("The quick brown fox").input_ids]
    assert len({len(p) for p in prompts}) == len(prompts)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model, config = load_model(smollm2_dir, "auto", torch.float32, CPU)
    drv = PagedDriver(model)
    ours = drv.generate([drv.new_request() for _ in prompts], prompts, 16, eos=config.eos_token_id)
    assert "Paris" in tok.decode(ours[0])
    # The shortest prompt is checked against generate() itself; the rest by one
    # teacher-forced forward each (the same greedy test, at a fraction of the CPU time).
    assert ours[1] == hf_greedy(hf, prompts[1], 16)
    for prompt, got in zip(prompts, ours, strict=True):
        assert hf_agrees_greedy(hf, prompt, got) == got
