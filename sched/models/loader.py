"""Builds a model and fills its weights: from a Hugging Face directory (config.json
+ safetensors, one file or sharded; FP8 ones through sgl.sched.models.fp8_checkpoint,
run with FP8 weights where the device can), from a GGUF file (dequantized, llama.cpp
names mapped to Hugging Face's, llama.cpp's Q/K rotary permutation undone), or
with seeded random weights ("dummy"). Under tensor parallelism every format is read
whole and the model keeps this rank's shard, so each rank holds a part of exactly
the model that one process would load.

It reads local files only: it never downloads, never imports transformers'
modelling code and never allocates KV memory."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgl.core.progress import progress_bar
from sgl.kernels.fp8_linear import fp8_supported
from sgl.sched.models.fp8_checkpoint import Fp8Checkpoint
from sgl.sched.models.llama import LlamaForCausalLM
from sgl.sched.models.lora_layers import LoraSpec
from sgl.sched.models.model_config import AnyConfig, model_config, read_model_config
from sgl.sched.models.parallel import TPGroup
from sgl.sched.models.registry import model_class

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

# GGUF architecture -> (transformers model_type, architecture class name)
_GGUF_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def load_model(
    model_path: str | None,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    seed: int = 0,
    tp: TPGroup = TPGroup(),
    lora: LoraSpec | None = None,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, AnyConfig]:
    """The model (eval mode, on `device`, in `dtype`; this rank's shard under `tp`; with
    `lora`, empty LoRA slots in its projections; with quantization "fp8", its projections'
    weights quantized to FP8 as they load) and its config."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    if model_path is None:
        raise ValueError(
            "no model path: pass a Hugging Face model directory or a .gguf file "
            "(the engine resolves its default model before calling the loader)"
        )
    device = torch.device(device)
    path = Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; sgl never downloads models: "
            "pass a local Hugging Face model directory or a .gguf file"
        )
    gguf_file = _gguf_file(path, load_format)
    gguf_ckpt = GGUFCheckpoint(gguf_file) if gguf_file is not None else None
    config = gguf_ckpt.config if gguf_ckpt is not None else hf_config(path)

    cls = model_class(getattr(config, "architectures", None))
    fp8_ckpt = Fp8Checkpoint.of(config) if gguf_ckpt is None else None
    model = cls(config, dtype=dtype, device=device, tp=tp, lora=lora)
    if (fp8_ckpt is not None and quantization is None and device.type == "cuda" and fp8_supported(device) is None
            and all(p.fp8_fits() for p in model.projections())):
        quantization = "fp8"  # stored in FP8: run so where the GPU can (a CPU's FP8 GEMM is a slow reference)
    if quantization == "fp8":
        model.quantize_fp8()
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}; choose fp8 or leave it unset")
    if load_format == "dummy":
        _init_dummy(model, seed)
    elif gguf_ckpt is not None:
        _fill(model, iter(gguf_ckpt), len(gguf_ckpt), str(gguf_file))
    else:
        files = safetensors_files(path)
        _fill(model, safetensors_tensors(files), _count_safetensors(files), str(path), fp8_ckpt)
    model.eval()
    return model, config


def _gguf_file(path: Path, load_format: str) -> Path | None:
    if path.is_file():
        if path.suffix == ".gguf" or load_format == "gguf":
            if load_format == "safetensors":
                raise ValueError(f"load_format='safetensors' but {str(path)!r} is a GGUF file: use 'auto' or 'gguf'")
            return path
        raise ValueError(
            f"{str(path)!r} is a file but not a .gguf file: pass a Hugging Face model directory or a .gguf file"
        )
    if load_format != "gguf":
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(
            f"load_format='gguf' needs exactly one .gguf file in {str(path)!r}, found {len(found)}: "
            "pass the file itself"
        )
    return found[0]


def hf_config(path: Path, trust_remote_code: bool = False) -> AnyConfig:
    """A model directory's config: read by sgl for the model types it builds (fast: no
    transformers config class is imported, see sgl.sched.models.model_config), else
    transformers' AutoConfig."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}: pass a Hugging Face model directory or a .gguf file")
    config = read_model_config(path)
    if config is not None:
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)


# ---- filling weights ----


def _fill(model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]], total: int, source: str,
          fp8_ckpt: Fp8Checkpoint | None = None) -> None:
    bar = progress_bar(weights, total=total, desc="Loading weights", unit="tensor")
    try:
        loaded = model.load_weights(bar if fp8_ckpt is None else fp8_ckpt.dequantized(bar))
    except KeyError as e:
        raise KeyError(f"{e.args[0]} (in {source})") from None
    finally:
        bar.close()
    missing = sorted(hf for ours, hf in model.expected_weights().items() if ours not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"missing weights in {source}: {shown}; is the checkpoint complete and for this architecture?")


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) for matrices and biases, ones for norm weights: random but
    numerically tame, so benchmarks see realistic magnitudes. The values are drawn for
    the whole model's parameters (a tp=1 twin on the meta device gives their shapes), in
    its order from one generator, and reach this rank through `load_weights`: every
    tp_size holds the same model for a seed."""
    whole = type(model)(model.config, dtype=model.dtype, device="meta")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in whole.named_parameters():
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            yield from whole.unfuse(name, t)

    with torch.no_grad():
        model.load_weights(tensors())


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {str(path)!r}: sgl reads safetensors checkpoints or .gguf files only"
        )
    return files


def _count_safetensors(files: list[Path]) -> int:
    from safetensors import safe_open

    n = 0
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            n += len(list(fh.keys()))
    return n


def safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, by name, in the files' order."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


# ---- GGUF ----


class GGUFCheckpoint:
    """A GGUF file read once: `.config` (a ModelConfig built from the metadata) and
    iteration over (Hugging Face name, float32 tensor)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self.arch = str(self.field("general.architecture"))
        if self.arch not in _GGUF_ARCHS:
            raise ValueError(
                f"GGUF architecture {self.arch!r} in {str(self.path)!r} is not supported; "
                f"supported: {', '.join(sorted(_GGUF_ARCHS))}"
            )
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise ValueError(
                f"{str(self.path)!r} stores per-frequency rope factors (Llama 3.1-style scaling), which sgl's "
                "GGUF reader does not support: load the Hugging Face directory of this model instead"
            )
        self.config = self._build_config(tie=("output.weight" not in names))

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.get_field(key)
        if f is None:
            return default
        if hasattr(f, "contents"):
            return f.contents()
        vals = [f.parts[i] for i in f.data]
        decoded = [bytes(v).decode() if v.dtype == np.uint8 else v.tolist()[0] for v in vals]
        return decoded[0] if len(decoded) == 1 else decoded

    def _build_config(self, tie: bool) -> AnyConfig:
        a = self.arch
        model_type, arch_name = _GGUF_ARCHS[a]
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        vocab = self.field(f"{a}.vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        kw: dict[str, object] = {
            "architectures": [arch_name],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self.field(f"{a}.attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": tie,
        }
        scaling_type = self.field(f"{a}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            if scaling_type != "linear":
                raise ValueError(f"GGUF rope scaling {scaling_type!r} in {str(self.path)!r} is not supported")
            kw["rope_scaling"] = {"rope_type": "linear", "factor": float(self.field(f"{a}.rope.scaling.factor"))}
        for key, attr in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
            tok = self.field(f"tokenizer.ggml.{key}_token_id")
            if tok is not None:
                kw[attr] = int(tok)
        config = model_config({"model_type": model_type, **kw})
        assert config is not None, model_type  # every GGUF architecture is one model_config reads
        return config

    def __len__(self) -> int:
        return len(self.reader.tensors)

    def hf_name(self, gguf_name: str) -> str:
        if gguf_name in _GGUF_GLOBAL_NAMES:
            return _GGUF_GLOBAL_NAMES[gguf_name]
        m = _BLOCK_RE.match(gguf_name)
        if m is None or m.group(2) not in _GGUF_BLOCK_NAMES:
            raise KeyError(f"unexpected GGUF tensor {gguf_name!r}: sgl has no mapping for it")
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        heads = self.config.num_attention_heads
        kv_heads = self.config.num_key_value_heads
        for t in self.reader.tensors:
            name = self.hf_name(t.name)
            arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            # GGUF lists dimensions fastest-first; torch wants them slowest-first.
            arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))
            # Only llama.cpp's "llama" converter permutes Q/K (weights and biases) for its rotary layout.
            if self.arch == "llama" and ".q_proj." in name:
                arr = unpermute_qk(arr, heads)
            elif self.arch == "llama" and ".k_proj." in name:
                arr = unpermute_qk(arr, kv_heads)
            yield name, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permutation, which regroups each head's rows from
    (half, pair) order into (pair, half) order: rows [h, 2, d/2] became [h, d/2, 2]."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
