"""Embedding routes: OpenAI's /v1/embeddings and SGLang's native /encode.

/v1/embeddings takes OpenAI's `input` (a string, a list of strings, a list of token
ids, or a list of such lists), `encoding_format` ("float", or "base64": the
little-endian float32 bytes, as OpenAI sends them), `dimensions` (a Matryoshka model's
truncation; a 400 naming it for another model), `model` and `user` (accepted, unused).
The engine's messages about `input_ids` come back naming `input`."""

from __future__ import annotations

import base64
from array import array
from typing import Any, Literal

import msgspec
from starlette.responses import Response

from sgl.runtime.embeddings import le_bytes
from sgl.server.common import ApiError, decode_body, json_response, renamed
from sgl.server.native import ServerState
from sgl.server.openai_api import check_model


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True):
    input: Any  # str | list[str] | list[int] | list[list[int]]: checked by `_inputs`
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # one list of ids, or a batch of them
    rid: str | list[str] | None = None
    dimensions: int | None = None


def _inputs(value: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's `input` as a batch of prompts or of id lists."""
    def ints(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

    if isinstance(value, str):
        return [value], None
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return value, None
        if ints(value):
            return None, [value]
        if all(ints(v) for v in value):
            return None, value
    if value == []:
        raise ApiError(400, "input: an empty list: give at least one string or list of token ids", "input",
                       "invalid_value")
    raise ApiError(400, "input: must be a string, a list of strings, a list of token ids or a list of such lists",
                   "input", "invalid_type")


async def embeddings(state: ServerState, body: bytes) -> Response:
    req = decode_body(body, EmbeddingRequest)
    check_model(state, req.model)
    texts, ids = _inputs(req.input)
    if texts is not None and any(t == "" for t in texts):
        raise ApiError(400, "input: an empty string cannot be embedded", "input", "invalid_value")
    try:
        outs = await state.engine.encode(texts, ids, None, req.dimensions)
    except ValueError as e:
        raise renamed(e, {"input_ids": "input", "prompt": "input"}) from None
    assert isinstance(outs, list)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(o["embedding"], req.encoding_format)}
            for i, o in enumerate(outs)]
    tokens = sum(int(o["meta_info"]["prompt_tokens"]) for o in outs)
    return json_response({"object": "list", "data": data, "model": state.model_name,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(le_bytes(array("f", vector))).decode("ascii")


async def encode(state: ServerState, body: bytes) -> Response:
    req = decode_body(body, EncodeRequest)
    return json_response(await state.engine.encode(req.text, req.input_ids, req.rid, req.dimensions))
