"""SamplingParams: what a request asks of the sampler and the stop logic.
Bottom layer: imports nothing of sgl. Validation errors are ValueErrors that
name the field and the allowed range."""

from __future__ import annotations

from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens, ">= 0")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0 (0 means greedy)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 (disabled) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "non-negative ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def coerce(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """Accept a SamplingParams, a plain dict, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")
        try:
            return msgspec.convert(value, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling_params: {e}") from None


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"sampling_params.{field}={value!r} is invalid: must be {allowed}")
