"""What every HTTP route shares: the error shape, reading and decoding a request
body within its size limit, Bearer-token checks, and server-sent events.

Errors use OpenAI's shape on every path, `{"error": {"message", "type", "param",
"code"}}`, so one client handles them all. Nothing here knows about engines."""

from __future__ import annotations

import hmac
import re
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sgl.core.request_checks import refield

T = TypeVar("T")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                503: "service_unavailable_error"}


class ApiError(Exception):
    """An error the client should see as `status` with OpenAI's error body. `code` is
    OpenAI's: a string such as "invalid_api_key", "model_not_found",
    "unknown_parameter", or null where OpenAI has none."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "internal_error"),
                          "param": self.param, "code": self.code}}


def json_response(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status_code=status, media_type="application/json")


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


_FIELD_AT = re.compile(r"(?:at|in) `\$\.([A-Za-z_][\w]*)")  # msgspec's "at `$.f`", "at `key` in `$.f`"
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_FIELD_NAMED = re.compile(r"(?:sampling_params\.)?([a-z_]+)=")
_FIELD_LEAD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*): ")
_FIELD_INDEXED = re.compile(r"^([a-z_]+)(?:\[\d+\])+[=:]")  # "prompt[3]=9", a batch's "prompt[1][3]=9"


def param_of(message: str) -> str | None:
    """Best guess of the request field an error message is about."""
    for pat in (_UNKNOWN, _FIELD_AT, _FIELD_INDEXED, _FIELD_NAMED, _FIELD_LEAD):
        m = pat.search(message)
        if m:
            return m.group(1)
    return None


def code_of(message: str) -> str | None:
    """OpenAI's error code for an invalid-input message, where it has one."""
    if "unknown field" in message:
        return "unknown_parameter"
    if "missing required field" in message:
        return "missing_required_parameter"
    if "Expected `" in message:
        return "invalid_type"
    if "context length" in message:
        return "context_length_exceeded"
    if " is invalid" in message or "must lie in" in message or "out of the vocabulary" in message:
        return "invalid_value"
    return None


def invalid(message: str) -> ApiError:
    return ApiError(400, message, param_of(message), code_of(message))


def renamed(e: ValueError, names: dict[str, str]) -> ApiError:
    """An engine's refusal as a 400 naming the route's field where the route calls the
    engine's by another name (names: engine field -> route field), as the message's lead."""
    return invalid(refield(str(e), names))


def api_error_of(e: Exception) -> ApiError:
    """What an exception from an engine call means to an HTTP client: invalid input
    (ValueError) is a 400, a dead or closed engine (RuntimeError) a 503."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ValueError):
        return invalid(str(e))
    if isinstance(e, (RuntimeError, ConnectionError)):
        return ApiError(503, str(e) or type(e).__name__)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}")


def check_content_type(request: Request) -> None:
    """Bodies are JSON: a 415 for one that says it is something else (a form, as `curl -d`
    sends without `-H 'Content-Type: application/json'`), as FastAPI servers (SGLang, vLLM)
    refuse it. No Content-Type at all is read as JSON."""
    declared = request.headers.get("content-type")
    if declared is None or not declared.strip():
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"Content-Type {media!r} is not supported: send the body as application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it exceeds `limit` bytes (never buffered past it);
    a 415 for a body declared as something other than JSON (check_content_type)."""
    check_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(body: bytes, type_: type[T]) -> T:
    """JSON into `type_`; every failure (bad JSON, invalid UTF-8, wrong types,
    unknown fields, failed validation) is a 400 naming the field where it can."""
    if not body.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise invalid(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # raised by a Struct's __post_init__
        raise invalid(str(e)) from None


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def sse_stream(events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """Each item as one `data:` event, a failure as one error event, then [DONE]."""
    try:
        async for item in events:
            yield sse(item)
    except Exception as e:  # noqa: BLE001 - the status line is gone: the error travels as an event
        yield sse(api_error_of(e).body())
    yield SSE_DONE
