"""Maps a Hugging Face architecture name (config.architectures[0]) to sgl's model
class. It only looks names up; it never builds or loads a model."""

from __future__ import annotations

from sgl.sched.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def model_class(architectures: list[str] | None) -> type[LlamaForCausalLM]:
    """The class for a config's `architectures` list (its first entry decides)."""
    if not architectures:
        raise ValueError(
            f"the model config names no architecture (config.architectures is empty); "
            f"supported: {', '.join(supported_architectures())}"
        )
    arch = architectures[0]
    try:
        return MODEL_REGISTRY[arch]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(supported_architectures())}"
        ) from None
