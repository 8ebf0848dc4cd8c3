"""SGLang's native HTTP routes: /generate, /health (liveness), /health_generate (a generation),
/get_model_info, /get_server_info, /flush_cache, /abort_request, /metrics, /version (the
control plane's are in control_api.py).

A /generate stream is SGLang's: each chunk holds everything so far (text, output
ids, logprobs), or only what is new with `incremental_streaming_output`; the
response's X-SGL-Stream-Output header says which.

Handlers turn HTTP into engine calls and back; they hold no request state of
their own, and never let bad input reach the scheduler unchecked."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sgl.core.server_args import redacted
from sgl.core.version import __version__
from sgl.engine import AsyncEngine, EngineFrontEnd
from sgl.server.common import SSE_HEADERS, ApiError, check_api_key, decode_body, json_response, renamed, sse_stream
from sgl.server.control_api import check_user_key, control_key

HEALTH_TIMEOUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass(slots=True)
class ServerState:
    engine: EngineFrontEnd  # an AsyncEngine, or an AttachedEngine
    model_name: str
    started: float  # time.monotonic() at start
    started_wall: float  # time.time() at start
    reasoning_marker_ids: list[list[int]] | None = None  # the reasoning parser's markers' ids, once encoded


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # one list of ids, or a batch of them
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    # SGLang's logprob fields; a list gives one value per prompt of a batch. The engine
    # validates them like its own keyword arguments.
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[Any] | None = None  # ids for every prompt, or a list of them per prompt
    return_text_in_logprobs: bool | None = None
    # Scheduling: SGLang's priority (higher first), a deadline in seconds from the scheduler's
    # receipt; a list gives one per prompt.
    priority: int | list[int] | None = None
    timeout: float | list[float] | None = None
    # The LoRA adapter (its name) that runs the request; a list gives one per prompt (None: the base model).
    lora_path: str | list[str | None] | None = None


_OPTION_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                  "return_text_in_logprobs", "priority", "timeout", "lora_path")


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    rid: str = ""
    abort_all: bool = False  # SGLang's: every request (needs the control key)


def options(req: GenerateRequest) -> dict[str, Any]:
    """The request-level fields that were given, as the engine's keyword arguments."""
    return {name: v for name in _OPTION_FIELDS if (v := getattr(req, name)) is not None}


async def primed(gen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Await the first chunk now, so that a bad request fails before any byte of a
    200 stream is sent; the returned iterator yields it and the rest, and closing
    it closes (and so aborts) the underlying stream."""
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await gen.aclose()  # type: ignore[attr-defined]
        raise

    async def rest() -> AsyncIterator[dict[str, Any]]:
        try:
            if first is not None:
                yield first
                async for chunk in gen:
                    yield chunk
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    return rest()


STREAM_OUTPUT_HEADER = "X-SGL-Stream-Output"  # "cumulative" or "incremental": what a /generate stream's chunks hold


async def generate(state: ServerState, request: Request, body: bytes) -> Response:
    req = decode_body(body, GenerateRequest)
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", "text")
    args = (req.text, req.sampling_params, req.input_ids, req.rid)
    try:
        if not req.stream:
            return json_response(await state.engine.generate(*args, **options(req)))
        chunks = await primed(state.engine.stream(*args, **options(req)))
    except ValueError as e:  # the engine calls this route's `text` its `prompt`
        raise renamed(e, {"prompt": "text"}) from None
    incremental = state.engine.args.incremental_streaming_output
    headers = {**SSE_HEADERS, STREAM_OUTPUT_HEADER: "incremental" if incremental else "cumulative"}
    return StreamingResponse(sse_stream(chunks if incremental else cumulative(chunks)),
                             media_type="text/event-stream", headers=headers)


async def cumulative(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """SGLang's default /generate stream: each chunk holds its request's text, output
    ids and logprob lists so far (the engine's chunks hold only what is new). A
    batch's requests are told apart by their "index". Each chunk is encoded before
    the next is made, so the growing lists are handed out without copies."""
    so_far: dict[int, dict[str, Any]] = {}
    async for c in chunks:
        acc = so_far.setdefault(c.get("index", 0), {"text": "", "output_ids": [], "meta": {}})
        out = dict(c)
        if "text" in c:
            acc["text"] += c["text"]
            out["text"] = acc["text"]
        acc["output_ids"].extend(c.get("output_ids") or ())
        out["output_ids"] = acc["output_ids"]
        meta = dict(c["meta_info"])
        for key, value in c["meta_info"].items():
            if key.endswith("_logprobs") and isinstance(value, list):
                acc["meta"].setdefault(key, []).extend(value)
        meta.update(acc["meta"])
        out["meta_info"] = meta
        yield out


async def health(state: ServerState) -> Response:
    """Liveness, answered by the server itself: 200 while every role runs and the
    engine is not dead, 503 once it is. No round trip to the scheduler, which may be
    busy in a long forward: a probe must not restart a healthy server (the deep
    check is /health_generate)."""
    reason = state.engine.dead_reason()
    if reason is not None:
        raise ApiError(503, f"the engine is dead: {reason}")
    return Response(status_code=200)


async def health_generate(state: ServerState) -> Response:
    """Healthy only if a one-token generation completes."""
    params = {"max_new_tokens": 1, "temperature": 0.0}
    try:
        await asyncio.wait_for(
            state.engine.generate(None, params, [0], f"health-{uuid.uuid4().hex}"), HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, asyncio.TimeoutError):
        raise ApiError(503, f"a one-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S}s") from None
    return Response(status_code=200)


def model_info(state: ServerState) -> Response:
    e = state.engine
    return json_response({"model_path": e.model_path, "tokenizer_path": e.files.tokenizer_path,
                          "served_model_name": state.model_name, "is_generation": True,
                          "context_length": e.info["context_length"], "vocab_size": e.info["vocab_size"]})


async def server_info(state: ServerState) -> Response:
    e = state.engine
    info = await e.get_server_info()
    roles: dict[str, Any] = {}  # an attached engine's roles are its server's
    if isinstance(e, AsyncEngine):
        roles = {"scheduler_address": e.roles.addresses.to_scheduler,
                 "role_pids": e.roles.pids()}
    return json_response({**redacted(e.args), **info, "model_path": e.model_path, **roles,
                          "uptime_s": time.monotonic() - state.started})


async def flush_cache(state: ServerState) -> Response:
    out = await state.engine.flush_cache()
    if not out["success"]:
        raise ApiError(400, f"cache not flushed: {out['message']}")
    return json_response(out)


async def abort_request(state: ServerState, request: Request, body: bytes) -> Response:
    req = decode_body(body, AbortRequest)
    args = state.engine.args
    if req.abort_all:
        check_api_key(request, control_key(args))
    else:
        check_user_key(request, args)
    if not req.abort_all:
        await state.engine.abort(req.rid)
        return json_response({"success": True})
    return json_response({"success": True, "aborted": await state.engine.abort_all()})


def version() -> Response:
    return json_response({"version": __version__})


async def metrics(state: ServerState) -> Response:
    try:
        info = await asyncio.wait_for(state.engine.get_server_info(), HEALTH_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a dead or slow scheduler still yields the counters
        info = None
    # The sglang:* series carry the served model name, as SGLang labels them.
    return Response(state.engine.metrics.render(info, state.model_name),
                    media_type="text/plain; version=0.0.4; charset=utf-8")
