"""SamplingParams: what a request asks of the sampler and the stop logic.

Bottom layer: imports nothing of sgl. Validation errors are ValueErrors that
name the field and the allowed range (SGLang's documented ranges). It does not
know the vocabulary: id ranges are checked where the vocabulary is known."""

from __future__ import annotations

import math
from typing import Any

import msgspec

# Fields a model's generation_config.json may default when the request leaves them unset.
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    logit_bias: dict[int, float] = {}
    custom_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens, ">= 0")
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", self.min_new_tokens,
               f"in [0, max_new_tokens={self.max_new_tokens}]")
        _check(self.temperature >= 0.0 and math.isfinite(self.temperature), "temperature", self.temperature,
               ">= 0 (0 means greedy)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 (disabled) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", self.repetition_penalty, "in (0, 2]")
        _check(self.n >= 1, "n", self.n, ">= 1")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "non-negative ids")
        _check(all(k >= 0 and math.isfinite(v) for k, v in self.logit_bias.items()), "logit_bias", self.logit_bias,
               "a map of non-negative token ids to finite floats")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or all(s for s in self.stop), "stop", self.stop, "non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def coerce(cls, value: SamplingParams | dict[str, Any] | None,
               defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Accept a SamplingParams, a plain dict, or None (defaults). `defaults` (from the
        model's generation config) fill the fields a dict or None leaves unset; a
        SamplingParams instance is taken as fully set."""
        if isinstance(value, cls):
            return value
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")
        if defaults:
            value = {**{k: v for k, v in defaults.items() if k not in value}, **value}
        try:
            return msgspec.convert(value, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling_params: {e}") from None


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"sampling_params.{field}={value!r} is invalid: must be {allowed}")
