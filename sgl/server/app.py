"""The HTTP application: routes of native, openai_api, embeddings_api and tokenize_api behind one
guard that checks the API key, reads the body within its limit, and turns every
failure into a JSON error; CORS (Starlette's middleware) for `allow_origins`. It
only wires; handlers live in those modules.

Every path but /health (and a CORS preflight) needs the API key when one is set;
the control routes (sgl/server/control_api.py, the LoRA routes of lora_api.py) need
the admin key instead when the server has one, which also opens every other path.
The served model name is `served_model_name`, else the model directory's name
(a .gguf file's without the suffix), else the default model's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sgl.core.log import get_logger
from sgl.server import control_api, embeddings_api, lora_api, native, tokenize_api
from sgl.server import openai_api as openai
from sgl.server.common import ApiError, api_error_of, check_api_key, error_response, read_body
from sgl.server.native import ServerState

Handler = Callable[[ServerState, Request, bytes], Awaitable[Response]]
log = get_logger("http")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what model_path=None serves


def served_model_name(args: Any, model_path: str | None) -> str:
    if args.served_model_name:
        return str(args.served_model_name)
    if args.model_path is None or not model_path:
        return DEFAULT_MODEL_NAME
    path = Path(model_path)
    return path.stem if path.suffix == ".gguf" else (path.name or str(path))


def build_app(engine: Any, model_name: str | None = None) -> Starlette:
    args = engine.args
    state = ServerState(engine, model_name or served_model_name(args, engine.model_path),
                        time.monotonic(), time.time())

    def guarded(handler: Handler, public: bool = False,
                admin: bool = False) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                if not public:
                    if admin:
                        check_api_key(request, control_api.control_key(args))
                    else:
                        control_api.check_user_key(request, args)
                body = await read_body(request, args.max_request_bytes) if request.method == "POST" else b""
                return await _unless_disconnected(request, handler(state, request, body))
            except ClientGone:
                return Response(status_code=499)  # nobody reads it: the connection is gone
            except Exception as e:  # noqa: BLE001 - every failure becomes a JSON error, never a crash
                err = api_error_of(e)
                if err.status >= 500:
                    log.warning("request failed", path=request.url.path, status=err.status, error=err.message)
                return error_response(err)

        return endpoint

    def route(path: str, handler: Handler, methods: tuple[str, ...], public: bool = False,
              admin: bool = False) -> Route:
        return Route(path, guarded(handler, public, admin), methods=list(methods))

    routes = [
        route("/health", lambda s, r, b: native.health(s), ("GET",), public=True),
        route("/health_generate", lambda s, r, b: native.health_generate(s), ("GET",)),
        route("/generate", native.generate, ("POST",)),
        route("/get_model_info", lambda s, r, b: _now(native.model_info(s)), ("GET",)),
        route("/get_server_info", lambda s, r, b: native.server_info(s), ("GET",)),
        route("/flush_cache", lambda s, r, b: native.flush_cache(s), ("GET", "POST"), admin=True),
        # Its key depends on its body (abort_all needs the control key): it checks it itself.
        route("/abort_request", native.abort_request, ("POST",), public=True),
        route("/get_weight_version", control_api.get_weight_version, ("GET",)),
        *(route(path, control_api.failing_as_sglang(handler), methods, admin=True)
          for path, (handler, methods) in (control_api.ROUTES | lora_api.ROUTES).items()),
        *(route(path, handler, methods, admin=True) for path, (handler, methods) in lora_api.VLLM_ROUTES.items()),
        route("/metrics", lambda s, r, b: native.metrics(s), ("GET",)),
        route("/version", lambda s, r, b: _now(native.version()), ("GET",)),
        route("/tokenize", lambda s, r, b: tokenize_api.tokenize(s, b), ("POST",)),
        route("/detokenize", lambda s, r, b: tokenize_api.detokenize(s, b), ("POST",)),
        route("/v1/tokenize", lambda s, r, b: tokenize_api.tokenize(s, b), ("POST",)),
        route("/v1/detokenize", lambda s, r, b: tokenize_api.detokenize(s, b), ("POST",)),
        route("/v1/models", lambda s, r, b: _now(openai.models(s)), ("GET",)),
        route("/v1/models/{model_id:path}", lambda s, r, b: openai.model(s, r.path_params["model_id"]), ("GET",)),
        route("/v1/completions", lambda s, r, b: openai.completions(s, b), ("POST",)),
        route("/v1/chat/completions", lambda s, r, b: openai.chat_completions(s, b), ("POST",)),
        route("/v1/embeddings", lambda s, r, b: embeddings_api.embeddings(s, b), ("POST",)),
        route("/encode", lambda s, r, b: embeddings_api.encode(s, b), ("POST",)),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    middleware = []
    if args.allow_origins:  # a preflight is answered here, before the key check
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(args.allow_origins), allow_methods=["*"],
                                     allow_headers=["*"], allow_credentials="*" not in args.allow_origins))
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=middleware)
    app.state.sgl = state
    return app


async def _now(resp: Response) -> Response:
    return resp


class ClientGone(Exception):
    """The client hung up before its response was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run the handler, cancelling it (and so aborting its requests) if the client
    disconnects first. Once the handler returns a response, the response itself
    (a stream) watches the connection."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone("the client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
