"""Chat messages to prompt ids through the tokenizer's chat template, for
/v1/chat/completions and the chat form of /tokenize. It checks the request and
builds the conversation; the tokenizer's process renders and encodes it
(sgl.runtime.tokenizer_client.chat_ids).

The template gets `tools` (OpenAI's `{"type": "function", "function": {...}}`
dicts, as Hugging Face templates read them) and an assistant's earlier
`tool_calls` with their JSON `arguments` text turned into objects, as vLLM hands
them over (templates such as Llama 3.1's and Qwen 2.5's write them with `tojson`)."""

from __future__ import annotations

import json
from typing import Any

from sgl.runtime.tokenizer_client import Tokenizing, chat_ids
from sgl.server.common import ApiError
from sgl.server.openai_protocol import ChatMessage

# apply_chat_template's own parameters: chat_template_kwargs may not set them.
_RESERVED = frozenset({"conversation", "tokenize", "return_dict", "return_tensors", "chat_template", "tools",
                       "documents", "add_generation_prompt", "continue_final_message", "padding", "truncation",
                       "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if not isinstance(content, list):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "messages: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its arguments as an object (when they are JSON text of one)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the template reads them: `developer` is `system`; an assistant's
    tool calls and a tool's answer keep their fields."""
    conv = []
    for m in messages:
        d: dict[str, Any] = {**m.extra, "role": "system" if m.role == "developer" else m.role,
                             "content": _text_of(m.content)}
        for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if (v := getattr(m, name)) is not None:
                d[name] = v
        if m.tool_calls is not None:
            d["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        conv.append(d)
    return conv


async def chat_prompt_ids(tok: Tokenizing | None, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's ids from the request's `messages` (ChatMessage.parse). `kwargs`
    (chat_template_kwargs) reach the template as variables, `tools` as its `tools`."""
    if tok is None:
        raise ApiError(400, "chat needs a tokenizer, and this server runs with skip_tokenizer_init", "messages")
    if not tok.has_chat_template:
        raise ApiError(400, "this model has no chat template: use /v1/completions, or start the server with "
                            "--chat-template", "messages")
    if not messages:
        raise ApiError(400, "messages is empty", "messages")
    bad = sorted(_RESERVED.intersection(kwargs or {}))
    if bad:
        raise ApiError(400, f"chat_template_kwargs: {', '.join(bad)} cannot be set there (a request field or "
                            "the server decides it)", "chat_template_kwargs")
    conv = conversation(ChatMessage.parse(messages))
    try:
        return await chat_ids(tok, conv, add_generation_prompt and not continue_final_message,
                              continue_final_message, tools, kwargs)
    except ValueError as e:  # a template that rejects this conversation
        raise ApiError(400, str(e), "messages") from None
