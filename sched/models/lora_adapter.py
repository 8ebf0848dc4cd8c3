"""One LoRA adapter in PEFT's format, read and checked against the base model.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (or the older
`adapter_model.bin` is refused: it is a pickle). `LoraAdapter.load` reads both, checks
every tensor against the model's shapes and the engine's limits before keeping any,
and holds the matrices in host memory: A as [r, in] and B as [out, r] with the
adapter's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA; per module under
`alpha_pattern`) folded in, in the model's dtype.

Supported: ranks up to the engine's max_lora_rank, targets among q/k/v/o and
gate/up/down of every decoder layer. Refused with a message saying why: DoRA,
trained biases, `modules_to_save`, embedding or LM head adapters, fan_in_fan_out
weights, anything else in the file. It never touches the device or the model."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# The projections an adapter may change, and whether each one's input is the model's
# hidden state (its A is [r, hidden]).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def module_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of the full model."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern the module's name ends with."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?{pattern}$", key):
            return value
    return default


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    targets: frozenset[str]  # the projections it changes
    # (layer, projection) -> (A [r, in], B [out, r] scaled), host tensors in the model's dtype
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @classmethod
    def load(cls, name: str, path: str, config: Any, dtype: torch.dtype, max_rank: int,
             targets: frozenset[str], pin: bool) -> LoraAdapter:
        """Read and check the adapter at `path` for a model of `config`; ValueError saying
        what is wrong (nothing is kept then). `targets`: the projections this engine's
        adapters may change; `pin`: keep it in pinned memory (fast copies to a GPU)."""
        folder = Path(path)
        where = f"LoRA adapter {name!r} ({path})"
        try:
            cfg = json.loads((folder / CONFIG_FILE).read_text())
        except FileNotFoundError:
            raise ValueError(f"{where}: no {CONFIG_FILE}: give a PEFT adapter folder") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: {CONFIG_FILE} is unreadable: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
        lora_alpha, rslora = cls._check_config(cfg, where)
        if not (folder / WEIGHTS_FILE).is_file():
            also = " (adapter_model.bin is a pickle, which is never loaded: save with safetensors)" if (
                folder / "adapter_model.bin").exists() else ""
            raise ValueError(f"{where}: no {WEIGHTS_FILE}{also}")
        shapes = module_shapes(config)
        layers = config.num_hidden_layers
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        try:
            with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
                for key in f.keys():
                    m = _KEY.fullmatch(key)
                    if m is None:
                        raise ValueError(f"{where}: tensor {key!r} is not a LoRA matrix of a decoder projection "
                                         f"({', '.join(TARGETS)}); embedding, LM head and other modules are not "
                                         "supported")
                    layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
                    if module not in shapes or layer >= layers:
                        raise ValueError(f"{where}: tensor {key!r} names no projection of this model "
                                         f"({layers} layers; {', '.join(TARGETS)})")
                    if module not in targets:
                        raise ValueError(f"{where}: it changes {module}, which this engine's adapters may not "
                                         f"(lora_target_modules: {', '.join(sorted(targets))}); start the engine "
                                         "with --lora-target-modules all")
                    parts.setdefault((layer, module), {})[ab] = f.get_tensor(key)
        except (OSError, RuntimeError) as e:  # safetensors' own errors for a damaged file
            raise ValueError(f"{where}: {WEIGHTS_FILE} is unreadable: {e}") from None
        if not parts:
            raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA matrices")
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        alpha_pattern = cfg.get("alpha_pattern") or {}
        for (layer, module), ab in sorted(parts.items()):
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
            a, b = ab["A"], ab["B"]
            n_in, n_out = shapes[module]
            r = a.shape[0] if a.dim() == 2 else -1
            if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
                raise ValueError(f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)} do not fit this model (expected [r, {n_in}] and [{n_out}, r])")
            if not 1 <= r <= max_rank:
                raise ValueError(f"{where}: rank {r} ({module}) is more than this engine's max_lora_rank="
                                 f"{max_rank}; start it with --max-lora-rank {r} or more")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ValueError(f"{where}: layer {layer} {module} holds NaN or infinite values")
            alpha = float(_pattern_value(alpha_pattern, f"model.layers.{layer}.{module}", lora_alpha))
            scaling = alpha / (math.sqrt(r) if rslora else r)
            a = a.to(dtype).contiguous()
            b = (b.float() * scaling).to(dtype).contiguous()
            weights[(layer, module)] = (a.pin_memory(), b.pin_memory()) if pin else (a, b)
        return cls(name, str(path), max(a.shape[0] for a, _ in weights.values()),
                   frozenset(m for _, m in weights), weights)

    @staticmethod
    def declared_rank(path: str) -> int:
        """The largest rank an adapter's config declares (r, rank_pattern); 0 if unreadable
        (its load then says why)."""
        try:
            cfg = json.loads((Path(path) / CONFIG_FILE).read_text())
            ranks = [cfg.get("r", 0), *(cfg.get("rank_pattern") or {}).values()]
            return max(int(r) for r in ranks if isinstance(r, int) and not isinstance(r, bool))
        except (OSError, ValueError, AttributeError):
            return 0

    @staticmethod
    def _check_config(cfg: dict[str, Any], where: str) -> tuple[float, bool]:
        """(lora_alpha, use_rslora) from a PEFT config; ValueError for what is not supported."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
        if cfg.get("use_dora"):
            raise ValueError(f"{where}: DoRA adapters (use_dora) are not supported")
        if cfg.get("bias", "none") != "none":
            raise ValueError(f"{where}: trained biases (bias={cfg.get('bias')!r}) are not supported; use bias='none'")
        if cfg.get("modules_to_save"):
            raise ValueError(f"{where}: modules_to_save ({cfg['modules_to_save']}) are not supported: the adapter "
                             "would replace whole modules of the base model")
        if cfg.get("lora_bias"):
            raise ValueError(f"{where}: LoRA biases (lora_bias) are not supported")
        if cfg.get("alora_invocation_tokens"):
            raise ValueError(f"{where}: activated LoRA (alora_invocation_tokens) is not supported")
        if cfg.get("layer_replication"):
            raise ValueError(f"{where}: layer_replication is not supported")
        if cfg.get("fan_in_fan_out"):
            raise ValueError(f"{where}: fan_in_fan_out weights (GPT-2's Conv1D layout) are not supported")
        alpha = cfg.get("lora_alpha", cfg.get("r", 8))
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise ValueError(f"{where}: lora_alpha {alpha!r} is not a number")
        return float(alpha), bool(cfg.get("use_rslora", False))
