"""The LoRA adapter routes (docs/lora.md): SGLang's /load_lora_adapter and
/unload_lora_adapter, answered as control_api answers (`{"success", "message",
"loaded_adapters"}`, a failure a 400 with SGLang's keys beside OpenAI's error body), and
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, answered as vLLM does: a 200
with a text message, an error in OpenAI's body (a 404 for unloading an adapter that is
not loaded). Every one needs the control key (app.py), as the other control routes.

Handlers check JSON types only; the engine checks the names and the scheduler the
adapter itself."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from sgl.engine.control_args import FieldError
from sgl.engine.lora_adapters import UnknownLoraAdapter
from sgl.server.common import ApiError, decode_body, invalid, json_response
from sgl.server.control_api import Handler, missing_field

T = TypeVar("T")

class LoadLoraAdapterBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    # SGLang's pinned (keep it on the device) is accepted and ignored: which adapters stay
    # on the device is the scheduler's choice, and never changes an output.
    pinned: bool = False
    # vLLM's load_inplace (replace a loaded adapter's weights): refused, unload then load instead.
    load_inplace: bool = False


class UnloadLoraAdapterBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's other way to name one: refused, sgl names adapters only by lora_name


def _decode(body: bytes, type_: type[T]) -> T:
    """The body, a missing field's 400 naming it (as control_api's routes do)."""
    try:
        return decode_body(body, type_)
    except ApiError as e:
        e.param = e.param or missing_field(e.message)
        raise


def _load_body(state: Any, body: bytes) -> LoadLoraAdapterBody:
    req = _decode(body, LoadLoraAdapterBody)
    if req.load_inplace:
        raise ApiError(400, "load_inplace is not supported: unload the adapter, then load it again",
                       "load_inplace", "unsupported_parameter")
    if req.lora_name == state.model_name:  # `model` would name the base model, never the adapter
        raise ApiError(400, f"lora_name={req.lora_name!r} is the served model's name: choose another",
                       "lora_name", "invalid_value")
    return req


def _unload_body(body: bytes) -> UnloadLoraAdapterBody:
    req = _decode(body, UnloadLoraAdapterBody)
    if req.lora_int_id is not None:
        raise ApiError(400, "lora_int_id is not supported: name the adapter by lora_name", "lora_int_id",
                       "unsupported_parameter")
    return req


# ---- SGLang's -------------------------------------------------------------------------

async def load_lora_adapter(state: Any, request: Request, body: bytes) -> Response:
    req = _load_body(state, body)
    out = await state.engine.load_lora_adapter(req.lora_name, req.lora_path)
    return json_response({**out, "message": out.get("message") or f"Loaded LoRA adapter {req.lora_name!r}."})


async def unload_lora_adapter(state: Any, request: Request, body: bytes) -> Response:
    req = _unload_body(body)
    out = await state.engine.unload_lora_adapter(req.lora_name)
    return json_response({**out, "message": out.get("message") or f"Unloaded LoRA adapter {req.lora_name!r}."})


# path -> (handler, methods): app.py wraps each in control_api.failing_as_sglang.
ROUTES: dict[str, tuple[Handler, tuple[str, ...]]] = {
    "/load_lora_adapter": (load_lora_adapter, ("POST",)),
    "/unload_lora_adapter": (unload_lora_adapter, ("POST",)),
}


# ---- vLLM's ---------------------------------------------------------------------------

def _as_vllm(e: ValueError) -> ApiError:
    """An engine's ValueError as vLLM's status: an adapter not loaded is a 404, else a 400."""
    if isinstance(e, UnknownLoraAdapter):
        return ApiError(404, str(e), e.field, "model_not_found")
    if isinstance(e, FieldError):
        return ApiError(400, str(e), e.field, "invalid_value")
    return invalid(str(e))


async def vllm_load_lora_adapter(state: Any, request: Request, body: bytes) -> Response:
    req = _load_body(state, body)
    try:
        await state.engine.load_lora_adapter(req.lora_name, req.lora_path)
    except ValueError as e:
        raise _as_vllm(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def vllm_unload_lora_adapter(state: Any, request: Request, body: bytes) -> Response:
    req = _unload_body(body)
    try:
        await state.engine.unload_lora_adapter(req.lora_name)
    except ValueError as e:
        raise _as_vllm(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


VLLM_ROUTES: dict[str, tuple[Handler, tuple[str, ...]]] = {
    "/v1/load_lora_adapter": (vllm_load_lora_adapter, ("POST",)),
    "/v1/unload_lora_adapter": (vllm_unload_lora_adapter, ("POST",)),
}
