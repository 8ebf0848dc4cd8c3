"""/tokenize and /detokenize (also under /v1/), in SGLang's and vLLM's shapes.

/tokenize takes `prompt` (a string, or SGLang's list of strings) with
`add_special_tokens` (default true), or vLLM's chat form, `messages` with
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and `tools`
(rendered as /v1/chat/completions renders them); it answers `{"tokens", "count",
"max_model_len"}`, plus `token_strs` when `return_token_strs` is true.
/detokenize takes `tokens` (ids, or a list of id lists) and answers `{"text"}`,
with vLLM's `prompt` beside it for a single list. The tokenizer work runs in the
tokenizer's process; nothing reaches the scheduler."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

from sgl.runtime.tokenizer_client import Tokenizing, decode, encode, token_strs
from sgl.server.chat_render import chat_prompt_ids
from sgl.server.common import ApiError, decode_body, json_response
from sgl.server.native import ServerState
from sgl.server.openai_api import check_model
from sgl.server.tool_calls import check_tools

MAX_BATCH = 1024  # the most prompts (or id lists) one call may hold


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None  # ChatMessage.parse
    add_special_tokens: bool | None = None  # default true; with messages only false (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None  # OpenAI's tools, for the template
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[Any]  # ids, or a list of id lists
    skip_special_tokens: bool = False


def _tokenizer(state: ServerState) -> Tokenizing:
    tok = state.engine.tm.tok
    if tok is None:
        raise ApiError(400, "this server runs with skip_tokenizer_init: it has no tokenizer")
    return tok


async def _encode(tok: Tokenizing, req: TokenizeRequest) -> list[list[int]]:
    """One id list per prompt (one for a single prompt or a conversation)."""
    if req.messages is not None:
        return [await chat_prompt_ids(tok, req.messages, req.add_generation_prompt, req.continue_final_message,
                                      req.chat_template_kwargs, check_tools(req.tools))]
    assert req.prompt is not None
    return await encode(tok, [req.prompt] if isinstance(req.prompt, str) else req.prompt,
                        req.add_special_tokens is not False)


async def tokenize(state: ServerState, body: bytes) -> Response:
    req = decode_body(body, TokenizeRequest)
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", "prompt")
    if req.tools is not None and req.messages is None:
        raise ApiError(400, "tools go with messages", "tools")
    check_tools(req.tools)
    if req.messages is not None and req.add_special_tokens:
        raise ApiError(400, "add_special_tokens=true is invalid with messages: the chat template adds them",
                       "add_special_tokens")
    if isinstance(req.prompt, list) and not 0 < len(req.prompt) <= MAX_BATCH:
        raise ApiError(400, f"prompt: a list of 1 to {MAX_BATCH} strings", "prompt")
    tok = _tokenizer(state)
    batch = await _encode(tok, req)
    one = not isinstance(req.prompt, list)
    out: dict[str, Any] = {"tokens": batch[0] if one else batch,
                           "count": len(batch[0]) if one else [len(i) for i in batch],
                           "max_model_len": state.engine.info["context_length"]}
    if req.return_token_strs:
        strs = await token_strs(tok, batch)
        out["token_strs"] = strs[0] if one else strs
    return json_response(out)


def _check_ids(state: ServerState, ids: list[int]) -> None:
    vocab = state.engine.info["vocab_size"]
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ApiError(400, f"tokens: ids must lie in [0, {vocab})", "tokens", "invalid_value")


async def detokenize(state: ServerState, body: bytes) -> Response:
    req = decode_body(body, DetokenizeRequest)
    check_model(state, req.model)
    tok = _tokenizer(state)
    one = not req.tokens or not isinstance(req.tokens[0], list)
    try:
        batch = [msgspec.convert(req.tokens, list[int])] if one else msgspec.convert(req.tokens, list[list[int]])
    except msgspec.ValidationError as e:
        raise ApiError(400, f"tokens: a list of token ids, or a list of those: {e}", "tokens", "invalid_type") from None
    if len(batch) > MAX_BATCH:
        raise ApiError(400, f"tokens: at most {MAX_BATCH} lists", "tokens")
    for ids in batch:
        _check_ids(state, ids)
    texts = await decode(tok, batch, req.skip_special_tokens)
    return json_response({"text": texts[0], "prompt": texts[0]} if one else {"text": texts})
