"""SGLang's control-plane routes: /pause_generation, /continue_generation,
/update_weights_from_disk, /update_weights_from_tensor, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group, /get_weights_by_name,
/release_memory_occupation, /resume_memory_occupation, /get_weight_version
(docs/control.md). /flush_cache and /abort_request with abort_all (native.py) need
the same key.

Bodies are SGLang's; fields of SGLang's that sgl honours by construction or that
cannot change what the engine does are accepted and ignored (named on each Struct),
any other field is a 400. Replies are SGLang's `{"success": true, "message", ...}`;
a failure is a 400 with OpenAI's error body plus SGLang's `"success": false` and
`"message"`, so clients of either shape read it. These routes need the admin key
when the server has one (`control_key`), else the API key; the admin key opens every
other route too (`check_user_key`).

Handlers check JSON types only; the engine checks values, naming the field."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sgl.core.protocol import SharedTensors
from sgl.core.server_args import ServerArgs
from sgl.engine.control_args import FieldError
from sgl.server.common import ApiError, check_api_key, decode_body, invalid, json_response

T = TypeVar("T")
Handler = Callable[[Any, Request, bytes], Awaitable[Response]]


def control_key(args: ServerArgs) -> str | None:
    """The Bearer token of the control routes: SGLang's admin key when set, else the API key."""
    return args.admin_api_key if args.admin_api_key is not None else args.api_key


def check_user_key(request: Request, args: ServerArgs) -> None:
    """The key of every other route: the API key, or the admin key, which opens every route."""
    try:
        check_api_key(request, args.api_key)
    except ApiError:
        if args.admin_api_key is None:
            raise
        check_api_key(request, args.admin_api_key)


class ControlFailed(ApiError):
    """A control call's failure: OpenAI's error body with SGLang's keys beside it."""

    def body(self) -> dict[str, Any]:
        return {**super().body(), "success": False, "message": self.message}


_MISSING = re.compile(r"missing required field `([^`]+)`")


def missing_field(message: str) -> str | None:
    """The field a decoding error says is missing, if it says one is."""
    found = _MISSING.search(message)
    return found.group(1) if found else None


def failing_as_sglang(handler: Handler) -> Handler:
    """Report a handler's invalid input or refused call (400) as a ControlFailed."""

    async def run(state: Any, request: Request, body: bytes) -> Response:
        try:
            return await handler(state, request, body)
        except ApiError as e:
            if e.status != 400:
                raise
            raise ControlFailed(400, e.message, e.param or missing_field(e.message), e.code) from None
        except FieldError as e:
            raise ControlFailed(400, str(e), e.field, "invalid_value") from None
        except ValueError as e:  # the scheduler refused the call
            err = invalid(str(e))
            raise ControlFailed(400, err.message, err.param, err.code) from None

    return run


def decode_or_default(body: bytes, type_: type[T]) -> T:
    """An empty body is the Struct's defaults (SGLang's clients post some calls bare)."""
    return type_() if not body.strip() else decode_body(body, type_)


def _ok(out: dict[str, Any], message: str, **extra: Any) -> Response:
    return json_response({**out, **extra, "message": out.get("message") or message})


class PauseGenerationBody(msgspec.Struct, forbid_unknown_fields=True):
    mode: str = "abort"
    refuse_new: bool = False  # sgl's: new requests end at once as busy (503) while paused


class ContinueGenerationBody(msgspec.Struct, forbid_unknown_fields=True):
    torch_empty_cache: bool = True  # ignored: the scheduler side manages its device memory


class WeightUpdateBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromDiskBody(WeightUpdateBody, forbid_unknown_fields=True, kw_only=True):
    model_path: str
    load_format: str | None = None
    # Accepted and ignored: every update is done when its reply comes (is_async), never
    # ends a pause, which only /continue_generation does (keep_pause), and leaves device
    # memory and CUDA graphs to the scheduler (torch_empty_cache, recapture_cuda_graph);
    # token_step is the trainer's own bookkeeping (use weight_version).
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class UpdateWeightsFromTensorBody(WeightUpdateBody, forbid_unknown_fields=True, kw_only=True):
    named_tensors: SharedTensors | None = None  # its bytes fields as base64, as msgspec writes them
    serialized_named_tensors: list[Any] | None = None  # SGLang's pickles: refused
    load_format: str | None = None


class InitWeightsUpdateGroupBody(msgspec.Struct, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedBody(WeightUpdateBody, forbid_unknown_fields=True, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class DestroyWeightsUpdateGroupBody(msgspec.Struct, forbid_unknown_fields=True):
    group_name: str = "weight_update_group"


class GetWeightsByNameBody(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    truncate_size: int = 100


class MemoryBody(msgspec.Struct, forbid_unknown_fields=True):
    tags: list[str] | None = None


PICKLES_REFUSED = ("serialized_named_tensors is refused: sgl never unpickles what it is sent. Send named_tensors "
                   "instead: a SharedTensors (sgl.weights.share_tensors(pairs).spec as JSON, bytes in base64), "
                   "keeping its buffer open until the reply, or use /update_weights_from_distributed")


async def pause_generation(state: Any, request: Request, body: bytes) -> Response:
    req = decode_or_default(body, PauseGenerationBody)
    out = await state.engine.pause_generation(req.mode, req.refuse_new)
    return _ok(out, "Generation paused successfully.", status="ok")


async def continue_generation(state: Any, request: Request, body: bytes) -> Response:
    decode_or_default(body, ContinueGenerationBody)
    out = await state.engine.continue_generation()
    return _ok(out, "Generation continued successfully.", status="ok")


async def update_weights_from_disk(state: Any, request: Request, body: bytes) -> Response:
    req = decode_body(body, UpdateWeightsFromDiskBody)
    out = await state.engine.update_weights_from_disk(
        req.model_path, req.load_format, flush_cache=req.flush_cache, abort_all_requests=req.abort_all_requests,
        weight_version=req.weight_version)
    return _ok({"num_paused_requests": 0, **out}, "Succeeded to update model weights.")


async def update_weights_from_tensor(state: Any, request: Request, body: bytes) -> Response:
    req = decode_body(body, UpdateWeightsFromTensorBody)
    if req.serialized_named_tensors is not None:
        raise ApiError(400, PICKLES_REFUSED, "serialized_named_tensors", "unsupported_parameter")
    if req.named_tensors is None:
        raise ApiError(400, "named_tensors is missing: send a SharedTensors", "named_tensors",
                       "missing_required_parameter")
    out = await state.engine.update_weights_from_tensor(
        req.named_tensors, load_format=req.load_format, flush_cache=req.flush_cache,
        abort_all_requests=req.abort_all_requests, weight_version=req.weight_version)
    return _ok(out, "Succeeded to update model weights.")


async def init_weights_update_group(state: Any, request: Request, body: bytes) -> Response:
    req = decode_body(body, InitWeightsUpdateGroupBody)
    out = await state.engine.init_weights_update_group(req.master_address, req.master_port, req.rank_offset,
                                                       req.world_size, req.group_name, req.backend)
    return _ok(out, "Succeeded to initialize the weight update group.")


async def update_weights_from_distributed(state: Any, request: Request, body: bytes) -> Response:
    req = decode_body(body, UpdateWeightsFromDistributedBody)
    out = await state.engine.update_weights_from_distributed(
        req.names, req.dtypes, req.shapes, group_name=req.group_name, flush_cache=req.flush_cache,
        abort_all_requests=req.abort_all_requests, weight_version=req.weight_version)
    return _ok(out, "Succeeded to update model weights.")


async def destroy_weights_update_group(state: Any, request: Request, body: bytes) -> Response:
    req = decode_or_default(body, DestroyWeightsUpdateGroupBody)
    out = await state.engine.destroy_weights_update_group(req.group_name)
    return _ok(out, "Succeeded to destroy the weight update group.")


async def get_weights_by_name(state: Any, request: Request, body: bytes) -> Response:
    """SGLang's reply: the values themselves, a JSON list. A GET takes its fields as query
    parameters (?name=...&truncate_size=...)."""
    if request.method == "GET":
        try:
            req = msgspec.convert(dict(request.query_params), GetWeightsByNameBody, strict=False)
        except msgspec.ValidationError as e:
            raise invalid(f"invalid request: {e}") from None
    else:
        req = decode_body(body, GetWeightsByNameBody)
    return json_response(await state.engine.get_weights_by_name(req.name, req.truncate_size))


async def release_memory_occupation(state: Any, request: Request, body: bytes) -> Response:
    req = decode_or_default(body, MemoryBody)
    return _ok(await state.engine.release_memory_occupation(req.tags), "Memory released.")


async def resume_memory_occupation(state: Any, request: Request, body: bytes) -> Response:
    req = decode_or_default(body, MemoryBody)
    return _ok(await state.engine.resume_memory_occupation(req.tags), "Memory resumed.")


async def get_weight_version(state: Any, request: Request, body: bytes) -> Response:
    return json_response({"weight_version": await state.engine.get_weight_version()})


# path -> (handler, methods): the routes that need the control key (app.py);
# /get_weight_version, a read, needs the API key only.
ROUTES: dict[str, tuple[Handler, tuple[str, ...]]] = {
    "/pause_generation": (pause_generation, ("POST",)),
    "/continue_generation": (continue_generation, ("POST",)),
    "/update_weights_from_disk": (update_weights_from_disk, ("POST",)),
    "/update_weights_from_tensor": (update_weights_from_tensor, ("POST",)),
    "/init_weights_update_group": (init_weights_update_group, ("POST",)),
    "/update_weights_from_distributed": (update_weights_from_distributed, ("POST",)),
    "/destroy_weights_update_group": (destroy_weights_update_group, ("POST",)),
    "/get_weights_by_name": (get_weights_by_name, ("GET", "POST")),
    "/release_memory_occupation": (release_memory_occupation, ("GET", "POST")),
    "/resume_memory_occupation": (resume_memory_occupation, ("GET", "POST")),
}
