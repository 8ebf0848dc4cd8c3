"""ServerArgs: every knob of an engine, with SGLang's names. Bottom layer: imports
nothing of sgl. Validated on construction; errors name the field."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Transport = Literal["inproc", "ipc", "tcp"]


class ServerArgs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model_path: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer_path: str | None = None
    load_format: Literal["auto", "safetensors", "gguf", "dummy", "null"] = "auto"  # null: instant fake logits (pipeline benchmarks)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trust_remote_code: bool = False
    context_length: int | None = None

    transport: Transport = "ipc"
    host: str = "127.0.0.1"

    max_total_tokens: int | None = None  # KV slots; None: sized from memory
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    skip_tokenizer_init: bool = False
    # Names (registered) or dotted paths (pkg.mod:Class) of logit processors requests may use.
    custom_logit_processors: list[str] = []

    random_seed: int | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    watchdog_interval: float = 0.5  # seconds between child liveness checks

    def __post_init__(self) -> None:
        _positive(self, "max_total_tokens", "context_length", "max_running_requests", "chunked_prefill_size")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} is invalid: must be >= 1")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} is invalid: must be in (0, 1)")
        if self.watchdog_interval <= 0:
            raise ValueError(f"watchdog_interval={self.watchdog_interval} is invalid: must be > 0")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments; a wrong name or type is a ValueError naming it."""
        try:
            return msgspec.convert(kwargs, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"server args: {e}") from None


def _positive(args: ServerArgs, *names: str) -> None:
    for name in names:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"{name}={v} is invalid: must be >= 1 (or None for the default)")
