"""LoRA adapters' names and the refusals about them, worded once for every side that
checks them: the engine front end (a fast path before anything is sent), the scheduler,
and the fake engine of sgl.testing. Each function returns a message that names the
caller's field and says what to do; none decides when to refuse. Bottom layer: imports
nothing of sgl but `LORA_NAME` and its wording."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sgl.core.server_args import LORA_NAME, LORA_NAME_RULE

NAME_RULE = f"must be an adapter's name: {LORA_NAME_RULE}"
DISABLED = ("this engine serves no LoRA adapters: start it with --lora-paths NAME=PATH (adapters loaded at start) "
            "or --enable-lora (adapters loaded at run time)")


def is_name(value: Any) -> bool:
    """Whether `value` is a valid adapter name (server_args.LORA_NAME)."""
    return isinstance(value, str) and LORA_NAME.fullmatch(value) is not None


def bad_name(field: str, value: Any) -> str:
    return f"{field}={value!r} is invalid: {NAME_RULE}"


def disabled(field: str) -> str:
    """A request or a load naming an adapter on an engine started without LoRA."""
    return f"{field}: {DISABLED}"


def not_loaded(field: str, name: str, loaded: Iterable[str]) -> str:
    """A request (field lora_path) or an unload (lora_name) naming an adapter that is not loaded."""
    return f"{field}: no LoRA adapter named {name!r} is loaded (loaded: {', '.join(sorted(loaded)) or 'none'})"


def name_in_use(name: str, path: str) -> str:
    """A load under a name already loaded, from any path (SGLang and vLLM refuse it too)."""
    return (f"lora_name: an adapter named {name!r} is loaded already (from {path}): unload it first, or load this "
            "one under another name")


def too_many(max_loaded_loras: int) -> str:
    return (f"lora_name: {max_loaded_loras} adapters are loaded, as many as max_loaded_loras allows: unload one "
            "first, or start the engine with a larger --max-loaded-loras")


def in_use_by_requests(name: str, requests: int) -> str:
    """An unload while live requests (queued or running) name the adapter."""
    return (f"lora_name: {requests} live requests use the adapter {name!r}: unload it once they end (or abort "
            "them first)")
