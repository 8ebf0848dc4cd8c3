"""sgl's own config.json reader (sgl.sched.models.model_config) against transformers'
AutoConfig: for random configs of every model type the registry builds, with any of
the optional keys left out, the model sgl builds from either config is the same
(parameters and their shapes, heads, head size, context, tied embeddings, RMS norm
epsilon, rotary tables) and so are the EOS ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sgl.sched.models.loader import hf_config
from sgl.sched.models.model_config import DEFAULTS, ModelConfig
from sgl.sched.models.registry import model_class
from sgl.sched.runner.model_runner import eos_ids_of

ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM"}
MISSING = object()


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A key's value, or MISSING: the key left out of the file."""
    return st.one_of(st.just(MISSING), strategy)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    model_type = draw(st.sampled_from(sorted(ARCH)))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    c: dict[str, Any] = {
        "model_type": model_type, "architectures": [ARCH[model_type]],
        "vocab_size": draw(st.integers(8, 64)), "hidden_size": heads * draw(st.sampled_from([4, 8, 16])),
        "intermediate_size": draw(st.integers(4, 48)), "num_hidden_layers": draw(st.integers(1, 2)),
        "num_attention_heads": heads,
    }
    kv_heads = [k for k in (1, 2, 4, 8) if heads % k == 0]
    drawn = {
        "num_key_value_heads": optional(st.one_of(st.none(), st.sampled_from(kv_heads))),
        "head_dim": optional(st.one_of(st.none(), st.sampled_from([4, 8]))),
        "max_position_embeddings": optional(st.sampled_from([64, 300, 1024])),
        "tie_word_embeddings": optional(st.booleans()),
        "rms_norm_eps": optional(st.sampled_from([1e-5, 1e-6])),
        "rope_theta": optional(st.sampled_from([10000.0, 500000.0])),
        "rope_scaling": optional(st.one_of(st.none(), st.just({"rope_type": "linear", "factor": 2.0}))),
        "eos_token_id": optional(st.one_of(st.none(), st.integers(0, 7), st.lists(st.integers(0, 7), max_size=2))),
        "bos_token_id": optional(st.one_of(st.none(), st.integers(0, 7))),
    }
    if model_type in ("llama", "qwen3"):
        drawn["attention_bias"] = optional(st.booleans())
    if model_type == "llama":
        drawn["mlp_bias"] = optional(st.booleans())
    if model_type == "mistral":
        drawn["sliding_window"] = optional(st.one_of(st.none(), st.sampled_from([16, 4096])))
    if model_type in ("qwen2", "qwen3"):
        drawn["use_sliding_window"] = optional(st.just(False))
        drawn["sliding_window"] = optional(st.one_of(st.none(), st.sampled_from([16, 4096])))
    for key, strategy in drawn.items():
        value = draw(strategy)
        if value is not MISSING:
            c[key] = value
    if c.get("num_key_value_heads") is None and model_type in ("qwen2", "qwen3", "mistral") \
            and "num_key_value_heads" not in c:
        assume(heads % DEFAULTS[model_type]["num_key_value_heads"] == 0)  # the class default must divide
    return c


def _view(config: Any, path: Path) -> dict[str, Any]:
    """What sgl's model built from `config` holds, and the EOS ids."""
    m = model_class(config.architectures)(config, dtype=torch.float32, device="cpu")
    return {
        "params": {k: tuple(v.shape) for k, v in m.state_dict().items()},
        "heads": (m.num_heads, m.num_kv_heads, m.head_dim), "context": m.context_len, "vocab": m.vocab_size,
        "tied": m.tie_word_embeddings, "eps": m.model.norm.eps, "layers": m.num_layers,
        "rope": (m.rope.cos, m.rope.sin), "eos": eos_ids_of(config, str(path)),
    }


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=configs())
def test_the_model_built_from_sgls_config_is_the_one_autoconfig_gives(values: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(values))
    try:
        theirs = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    except Exception:  # noqa: BLE001 - its validators raise several types
        assume(False)  # a config transformers refuses is not one to compare
    ours = hf_config(tmp_path)
    assert isinstance(ours, ModelConfig)
    a, b = _view(ours, tmp_path), _view(theirs, tmp_path)
    for key in ("rope",):
        assert all(torch.equal(x, y) for x, y in zip(a.pop(key), b.pop(key))), key
    assert a == b


def test_other_model_types_go_through_autoconfig(tmp_path: Path) -> None:
    """A model type sgl does not read by itself is transformers' to read (the registry
    then names what it supports)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16}))
    config = hf_config(tmp_path)
    assert not isinstance(config, ModelConfig)
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        model_class(config.architectures)


def test_a_config_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        hf_config(tmp_path)
