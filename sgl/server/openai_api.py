"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Requests are msgspec Structs (unknown fields are a 400); sampling fields, OpenAI's
and SGLang's extras, are passed to the engine as a plain dict, so SamplingParams
alone decides what is valid. Streams are server-sent events ending in an
optional usage chunk and `data: [DONE]`.

Logprobs come from the engine's (logprob, id, text) triples, each token decoded on
its own: completions get OpenAI's legacy lists (`echo` adds the prompt's, first one
null), chat gets `content` entries; a streamed chunk carries its own tokens'.

Beam search takes vLLM's extra fields (`use_beam_search` with `n` beams,
`length_penalty`, `early_stopping`) or `beam_width` (then `n` is how many beams
come back): the n choices are the beams, best first; it never streams."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from starlette.responses import Response, StreamingResponse

from sgl.server.common import SSE_HEADERS, ApiError, decode_body, json_response, sse_stream
from sgl.server.native import ServerState, primed

MAX_LOGPROBS = 20  # the most top logprobs a position may ask for (vLLM's default max_logprobs)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The sampling fields both endpoints take: OpenAI's, then SGLang's extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None
    # Beam search: vLLM's use_beam_search (n beams), or beam_width itself (n: how many to return).
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# A field that equals its neutral value is left out, so a client sending OpenAI's
# defaults never trips on a field the sampler does not know.
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
_PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "stop_token_ids", "ignore_eos", "skip_special_tokens",
           "spaces_between_special_tokens", "no_stop_trim", "length_penalty", "early_stopping", *_NEUTRAL)


def sampling_dict(req: _Sampling, max_tokens: int | None) -> dict[str, Any]:
    sp: dict[str, Any] = {}
    for name in _PASSED:
        v = getattr(req, name)
        if v is not None and _NEUTRAL.get(name, object()) != v:
            sp[name] = v
    if "min_tokens" in sp:
        sp["min_new_tokens"] = sp.pop("min_tokens")  # vLLM's name for SGLang's field
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    if req.use_beam_search or req.beam_width:
        sp.update(beam_fields(req))
    elif req.n != 1:
        sp["n"] = req.n  # the samples share the prompt's KV through the radix cache
    if req.logit_bias:
        sp["logit_bias"] = req.logit_bias  # OpenAI sends token ids as strings; SamplingParams converts them
    if req.stop is not None and req.stop != []:
        sp["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    return sp


def beam_fields(req: _Sampling) -> dict[str, Any]:
    """The sampling fields of a beam-search request, which returns n choices, best first."""
    if req.stream:
        raise ApiError(400, "stream=true is not supported with beam search: the beams come back once they finish",
                       "stream")
    if getattr(req, "logprobs", None) not in (None, False):
        raise ApiError(400, "logprobs is not supported with beam search (each beam has its cumulative logprob)",
                       "logprobs")
    width = req.beam_width or req.n
    if req.n > width:
        raise ApiError(400, f"n={req.n} is invalid: at most beam_width={width} beams can be returned", "n")
    return {"beam_width": width, "num_return_beams": req.n}


def finish_reason(fin: dict[str, Any] | None) -> str | None:
    return None if fin is None else fin["type"]


def usage(groups: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """OpenAI usage from the meta_info of each prompt's samples: a prompt's tokens (and
    how many of them the radix cache held, from its first sample, which prefilled it)
    once, every sample's completion tokens."""
    p = sum(g[0]["prompt_tokens"] for g in groups)
    c = sum(m["completion_tokens"] for g in groups for m in g)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if cached := sum(g[0].get("cached_tokens") or 0 for g in groups):
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _prompts(prompt: str | list[Any]) -> list[tuple[str | None, list[int] | None]]:
    """(text, ids) per prompt: a string, a list of ids, or a batch of either."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt]
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [(None, prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [(None, p) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids, or a list of those", "prompt")


def _check_top(value: int | None, name: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{name}={value} is invalid: must be in [0, {MAX_LOGPROBS}]", name)


def logprob_options(top: int, prompt: bool) -> dict[str, Any]:
    """The engine's request options for logprobs with `top` alternatives per position,
    of the prompt's tokens too if `prompt`."""
    return {"return_logprob": True, "top_logprobs_num": top, "return_text_in_logprobs": True,
            "logprob_start_len": 0 if prompt else -1}


Triple = tuple[float | None, int, str]  # (logprob, token id, token text) as meta_info holds them


def _rows(meta: dict[str, Any], prompt: bool) -> tuple[list[Triple], list[list[Triple] | None]]:
    """Each position's chosen triple and its top triples: the prompt's (if asked) then the output's."""
    toks = list(meta["output_token_logprobs"])
    tops = list(meta.get("output_top_logprobs") or [None] * len(toks))
    if prompt:
        inp = meta["input_token_logprobs"]
        toks[:0] = inp
        tops[:0] = meta.get("input_top_logprobs") or [None] * len(inp)
    return toks, tops


def completion_logprobs(meta: dict[str, Any], prompt: bool, offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs. `offset`: the text offset of the first token. Offsets add
    up the token strings' lengths, so they drift from the text where the detokenizer
    drops (special) or merges (split UTF-8) what single-token decoding shows."""
    toks, tops = _rows(meta, prompt)
    offsets = []
    for _, _, text in toks:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [t for _, _, t in toks], "token_logprobs": [v for v, _, _ in toks],
            "top_logprobs": [_top_dict(t, row) for t, row in zip(toks, tops)], "text_offset": offsets}


def _top_dict(chosen: Triple, row: list[Triple] | None) -> dict[str, float | None] | None:
    if chosen[0] is None:
        return None  # the first prompt token has no logprob
    top = {text: v for v, _, text in row or ()}
    top.setdefault(chosen[2], chosen[0])  # OpenAI: the sampled token is always there, so up to logprobs + 1
    return top


def chat_logprobs(meta: dict[str, Any]) -> dict[str, Any]:
    toks, tops = _rows(meta, prompt=False)
    return {"content": [{**_chat_token(t), "top_logprobs": [_chat_token(x) for x in row or ()]}
                        for t, row in zip(toks, tops)]}


def _chat_token(t: Triple) -> dict[str, Any]:
    # The bytes of the token's own decoding: a token holding part of a UTF-8 character shows as U+FFFD.
    return {"token": t[2], "logprob": t[0], "bytes": list(t[2].encode())}


def _check_completion(state: ServerState, req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported: this server does no fill-in-the-middle", "suffix")
    if req.best_of not in (None, 1):
        raise ApiError(400, f"best_of={req.best_of} is not supported: only best_of=1 (use n for several samples)",
                       "best_of")
    _check_top(req.logprobs, "logprobs")
    if (req.echo or req.logprobs is not None) and state.engine.tokenizer is None:
        name = "echo" if req.echo else "logprobs"
        raise ApiError(400, f"{name} needs a tokenizer, and this server runs with skip_tokenizer_init", name)


async def completions(state: ServerState, body: bytes) -> Response:
    req = decode_body(body, CompletionRequest)
    _check_completion(state, req)
    sp = sampling_dict(req, req.max_tokens)
    prompts = _prompts(req.prompt)
    opts = {} if req.logprobs is None else logprob_options(req.logprobs, req.echo)
    created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    if len(prompts) > 1 and req.rid is not None:
        raise ApiError(400, "rid: a batch of prompts takes no rid", "rid")
    if req.stream:
        return await _stream_completion(state, req, prompts, sp, opts, cid, created)
    if len(prompts) == 1:
        per_prompt = [await state.engine.generate(prompts[0][0], sp, prompts[0][1], req.rid, **opts)]
    else:
        per_prompt = await asyncio.gather(*(state.engine.generate(t, sp, i, **opts) for t, i in prompts))
    # With n > 1 each prompt gives a list of n samples: choice index = prompt index * n + sample.
    groups = [o if isinstance(o, list) else [o] for o in per_prompt]
    echoes = [_echo_text(state, t, i) if req.echo else "" for t, i in prompts]
    outs = [(echo, o) for echo, g in zip(echoes, groups) for o in g]
    choices = [{"index": k, "text": echo + o["text"],
                "logprobs": None if req.logprobs is None else completion_logprobs(o["meta_info"], req.echo, 0),
                "finish_reason": finish_reason(o["meta_info"]["finish_reason"])} for k, (echo, o) in enumerate(outs)]
    return json_response({"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                          "choices": choices, "usage": usage([[o["meta_info"] for o in g] for g in groups])})


async def _stream_completion(state: ServerState, req: CompletionRequest,
                             prompts: list[tuple[str | None, list[int] | None]], sp: dict[str, Any],
                             opts: dict[str, Any], cid: str, created: int) -> Response:
    """One prompt's or a batch's choices, streamed interleaved; the engine numbers a
    batch's chunks prompt_index * n + sample_index, as the choices are numbered."""
    if len(prompts) == 1:
        chunks = await primed(state.engine.stream(prompts[0][0], sp, prompts[0][1], req.rid, **opts))
    else:
        texts, ids = [t for t, _ in prompts], [i for _, i in prompts]
        chunks = await primed(state.engine.stream(None if texts[0] is None else texts, sp,
                                                  None if ids[0] is None else ids, **opts))
    echoes = [_echo_text(state, t, i) if req.echo else "" for t, i in prompts]
    offsets: dict[int, int] = {}  # each choice's text offset so far; absent before its first chunk

    def chunk(c: dict[str, Any]) -> dict[str, Any]:
        i = c.get("index", 0)
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(c["meta_info"], req.echo, offsets.get(i, 0))
        text = c["text"] if i in offsets else echoes[i // req.n] + c["text"]
        choice = {"index": i, "text": text, "logprobs": lp,
                  "finish_reason": finish_reason(c["meta_info"]["finish_reason"])}
        offsets[i] = offsets.get(i, 0) + (sum(map(len, lp["tokens"])) if lp else 0)
        return {"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": [choice]}

    return _sse(_openai_stream(chunks, chunk, req, cid, "text_completion", created, state.model_name))


def _echo_text(state: ServerState, text: str | None, ids: list[int] | None) -> str:
    return text if text is not None else state.engine.tokenizer.decode(ids)


def chat_prompt_ids(state: ServerState, messages: list[ChatMessage]) -> list[int]:
    tok = state.engine.tokenizer
    if tok is None:
        raise ApiError(400, "chat needs a tokenizer, and this server runs with skip_tokenizer_init", "messages")
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    if not messages:
        raise ApiError(400, "messages is empty", "messages")
    conv = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, "messages: only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        conv.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    try:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template that rejects this conversation
        raise ApiError(400, f"messages: the chat template rejected them: {e}", "messages") from None
    return list(tok.encode(text, add_special_tokens=False))


async def chat_completions(state: ServerState, body: bytes) -> Response:
    req = decode_body(body, ChatRequest)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    _check_top(req.top_logprobs, "top_logprobs")
    sp = sampling_dict(req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens)
    ids = await state.engine.tm.run_sync(chat_prompt_ids, state, req.messages)  # the template, off the loop
    opts = logprob_options(req.top_logprobs or 0, prompt=False) if req.logprobs else {}
    created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        chunks = await primed(state.engine.stream(None, sp, ids, req.rid, **opts))
        seen: set[int] = set()

        def chunk(c: dict[str, Any]) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": c["text"]}
            if c.get("index", 0) not in seen:  # each choice's first delta names the role
                delta["role"] = "assistant"
                seen.add(c.get("index", 0))
            choice = {"index": c.get("index", 0), "delta": delta,
                      "logprobs": chat_logprobs(c["meta_info"]) if req.logprobs else None,
                      "finish_reason": finish_reason(c["meta_info"]["finish_reason"])}
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                    "choices": [choice]}

        return _sse(_openai_stream(chunks, chunk, req, cid, "chat.completion.chunk", created, state.model_name))
    res = await state.engine.generate(None, sp, ids, req.rid, **opts)
    outs = res if isinstance(res, list) else [res]
    choices = [{"index": k, "message": {"role": "assistant", "content": o["text"]},
                "logprobs": chat_logprobs(o["meta_info"]) if req.logprobs else None,
                "finish_reason": finish_reason(o["meta_info"]["finish_reason"])} for k, o in enumerate(outs)]
    return json_response({"id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
                          "choices": choices, "usage": usage([[o["meta_info"] for o in outs]])})


async def _openai_stream(chunks: AsyncIterator[dict[str, Any]], shape: Any, req: _Sampling, cid: str, obj: str,
                         created: int, model: str) -> AsyncIterator[dict[str, Any]]:
    last: dict[int, dict[str, Any]] = {}  # each choice's latest meta_info
    async for c in chunks:
        last[c.get("index", 0)] = c["meta_info"]
        out = shape(c)
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            out["usage"] = _stream_usage(last, req.n)
        yield out
    if last and req.stream_options is not None and req.stream_options.include_usage:
        yield {"id": cid, "object": obj, "created": created, "model": model, "choices": [],
               "usage": _stream_usage(last, req.n)}


def _stream_usage(last: dict[int, dict[str, Any]], n: int) -> dict[str, Any]:
    """The usage so far of the choices seen; choice i belongs to prompt i // n."""
    per_prompt: dict[int, list[dict[str, Any]]] = {}
    for i, m in sorted(last.items()):
        per_prompt.setdefault(i // n, []).append(m)
    return usage(list(per_prompt.values()))


def _sse(events: AsyncIterator[dict[str, Any]]) -> Response:
    return StreamingResponse(sse_stream(events), media_type="text/event-stream", headers=SSE_HEADERS)


def models(state: ServerState) -> Response:
    e = state.engine
    return json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(state.started_wall), "owned_by": "sgl",
        "root": e.model_path, "max_model_len": e.info["context_length"]}]})
