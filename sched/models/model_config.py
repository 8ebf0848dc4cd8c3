"""A model's configuration for sgl's model classes, read from a Hugging Face
config.json (or built from a GGUF file's fields) without transformers' config classes.

Why by hand: AutoConfig resolves a model_type by importing its configuration module,
and in transformers 5 that module's `@auto_docstring` imports transformers' modeling
registry and generation utilities, and with them torch.distributed.tensor, sympy,
torch._dynamo and, where installed, sklearn, scipy and pandas: about 12 s of each
scheduler start on the H200 host (py-spy, benchmarks/RESULTS.md, 2026-12-02) for a
few numbers. The file's keys are kept as they are; a key it leaves out takes the
default of transformers' class for its model_type, with the same derived values
(`head_dim`, `num_key_value_heads`, Qwen's `sliding_window` and `layer_types`), for
the model types the registry builds. tests/test_model_config.py checks every model
built from one against the model built from AutoConfig's. Other model types return
None: the caller falls back to AutoConfig. This module must not grow into a second
transformers: it covers only what sgl.sched.models reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_BASE: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "head_dim": None, "architectures": None,
}
_QWEN: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
}
# transformers 5's class defaults, by model_type (its configuration_<type>.py).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
              "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128},
}


class ModelConfig(SimpleNamespace):
    """A config.json's keys as attributes, with its model_type's defaults filled in."""

    model_type: str

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def save(self, directory: str | Path) -> None:
        """Write config.json (transformers reads it back as its own class)."""
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


# What the model classes are built from: this module's config, or AutoConfig's for other types.
AnyConfig: TypeAlias = "ModelConfig | PretrainedConfig"


def model_config(values: dict[str, Any]) -> ModelConfig | None:
    """The config for `values` (a config.json's keys, model_type among them), or None
    when their model_type is not one sgl reads by itself."""
    model_type = values.get("model_type")
    if model_type not in DEFAULTS:
        return None
    c = {**_BASE, **DEFAULTS[model_type], **values}
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    if model_type in ("llama", "mistral") and c["head_dim"] is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    if model_type in ("qwen2", "qwen3"):
        c["sliding_window"] = c["sliding_window"] if c["use_sliding_window"] else None
        if c["layer_types"] is None:
            c["layer_types"] = ["sliding_attention" if c["sliding_window"] is not None and i >= c["max_window_layers"]
                                else "full_attention" for i in range(c["num_hidden_layers"])]
    return ModelConfig(**c)


def read_model_config(directory: Path) -> ModelConfig | None:
    """config.json of a model directory, read as `model_config` does (None: another model_type)."""
    values = json.loads((directory / "config.json").read_text())
    if not isinstance(values, dict):
        raise ValueError(f"{str(directory / 'config.json')!r} does not hold a JSON object")
    return model_config(values)
