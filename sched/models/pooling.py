"""Embedding requests: how a model pools its prompt's final hidden states into one
vector (`PoolingConfig`, from the model's files and the server arguments) and one
request's pool as its prompt's chunks come in (`PooledPrompt`).

The model's files decide as sentence-transformers records it: `modules.json` lists a
Pooling module (its `config.json`: `pooling_mode_lasttoken` or
`pooling_mode_mean_tokens`) and, when the vectors are normalised, a Normalize module.
A model without them (Qwen3-Embedding's and gte-Qwen2's checkpoints have them; a bare
decoder forced with `is_embedding` may not) pools its last token and normalises, as
SGLang's and vLLM's decoder embedding models do. `pooling` in the server arguments
overrides the mode. Matryoshka truncation (`dimensions`) is allowed only when config.json
says the model was trained for it, as vLLM reads it: `is_matryoshka`, or the allowed
sizes in `matryoshka_dimensions`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

PoolingMode = Literal["last", "mean"]
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_MODES: dict[str, PoolingMode | None] = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                                         "pooling_mode_cls_token": None, "pooling_mode_max_tokens": None,
                                         "pooling_mode_mean_sqrt_len_tokens": None,
                                         "pooling_mode_weightedmean_tokens": None}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool
    hidden_size: int  # the vector's length
    # Sizes `dimensions` may truncate to: None: none (no Matryoshka training), (): any up to hidden_size.
    matryoshka: tuple[int, ...] | None

    def info(self) -> dict[str, Any]:
        """The scheduler's server info entry, which the caller's side reads."""
        return {"pooling": self.mode, "normalize": self.normalize, "hidden_size": self.hidden_size,
                "matryoshka": None if self.matryoshka is None else list(self.matryoshka)}


def pooling_config(model_dir: Path, config: Any, is_embedding: bool, override: str) -> PoolingConfig | None:
    """The model's pooling, or None when it serves no embeddings (no sentence-transformers
    Pooling module and not `is_embedding`). Raises ValueError for a pooling sgl cannot do."""
    modules = _modules(model_dir)
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None and not is_embedding:
        return None
    mode: PoolingMode = "last"
    if pooling is not None:
        mode = _st_mode(model_dir / str(pooling.get("path", "")) / "config.json")
    if override != "auto":
        mode = "last" if override == "last" else "mean"
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules) if pooling is not None else True
    hidden = int(config.hidden_size)
    dims = getattr(config, "matryoshka_dimensions", None)
    matryoshka = (tuple(sorted(int(d) for d in dims)) if dims
                  else () if getattr(config, "is_matryoshka", False) else None)
    return PoolingConfig(mode, normalize, hidden, matryoshka)


def _modules(model_dir: Path) -> list[dict[str, Any]]:
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def _st_mode(path: Path) -> PoolingMode:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"the model's sentence-transformers pooling config {str(path)!r} is unreadable: {e}") from e
    on = [k for k, v in values.items() if k in _MODES and v is True]
    if len(on) != 1 or _MODES[on[0]] is None:
        raise ValueError(f"{str(path)!r}: pooling {', '.join(on) or 'none'} is not supported for decoder models "
                         "(supported: pooling_mode_lasttoken, pooling_mode_mean_tokens)")
    return _MODES[on[0]]  # type: ignore[return-value]


class PooledPrompt:
    """One embedding request's pool, on the host in float64: the running sum of its
    prompt's final hidden states (mean) or the last one (last token). A chunked prompt
    adds each chunk's sum; a retracted request starts over (`reset`)."""

    __slots__ = ("mode", "normalize", "total", "tokens")

    def __init__(self, mode: PoolingMode, normalize: bool) -> None:
        self.mode = mode
        self.normalize = normalize
        self.total: torch.Tensor | None = None
        self.tokens = 0

    def reset(self) -> None:
        self.total, self.tokens = None, 0

    def add(self, row: torch.Tensor, tokens: int) -> None:
        """A step's pooled row for this request ([hidden] float32: a chunk's sum of `tokens`
        hidden states, or the last token's)."""
        row = row.to(torch.float64)
        self.total = row if self.total is None or self.mode == "last" else self.total + row
        self.tokens += tokens

    def vector(self) -> bytes:
        """The embedding as little-endian float32 bytes (OpenAI's base64 layout)."""
        assert self.total is not None and self.tokens > 0, "an embedding before any pooled row"
        v = self.total / self.tokens if self.mode == "mean" else self.total
        if self.normalize:
            v = v / v.norm().clamp_min(1e-12)
        return v.to(torch.float32).numpy().astype("<f4", copy=False).tobytes()
