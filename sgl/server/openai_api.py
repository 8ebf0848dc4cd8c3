"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models,
/v1/models/{id}.

Requests are msgspec Structs (openai_protocol: unknown fields are a 400, fields
that do not apply are ignored, unimplemented ones refused); sampling fields,
OpenAI's and SGLang's extras, are passed to the engine as a plain dict, so
SamplingParams alone decides what is valid, and its errors come back in the
caller's field names. A `model` other than the served name or a loaded LoRA adapter's
is a 404 (as vLLM); naming an adapter runs it (vLLM's way), as SGLang's `lora_path` does,
and responses report the name the caller gave. /v1/models lists the adapters after the
base model, in vLLM's shape.
Streams are server-sent events ending in an optional usage chunk and `data: [DONE]`.
Choices carry SGLang's `matched_stop` (the stop string or token id that ended them, or
the text a stop_regex matched). Usage always has prompt_tokens_details.cached_tokens.
vLLM's `prompt_logprobs` come back per choice (completions) or on the response (chat),
never streamed.

Chat takes OpenAI's tools, tool_choice and parallel_tool_calls (server/tool_calls:
a forced choice is enforced by the grammar, "auto" read by the server's
--tool-call-parser); choices then carry `tool_calls`, streams their deltas.
With a --reasoning-parser (server/reasoning) a choice's thinking comes apart as
`reasoning_content` (and vLLM's `reasoning`), streamed as such deltas before the
content; tools are read from the content only; a grammar applies after the thinking;
usage counts `completion_tokens_details.reasoning_tokens`.

Beam search takes vLLM's extra fields (`use_beam_search` with `n` beams,
`length_penalty`, `early_stopping`) or `beam_width` (then `n` is how many beams
come back): the n choices are the beams, best first; it never streams."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from sgl.runtime.tokenizer_client import decode, encode
from sgl.server.chat_render import chat_prompt_ids
from sgl.server.common import SSE_HEADERS, ApiError, decode_body, json_response, sse_stream
from sgl.server.native import ServerState, primed
from sgl.server.openai_logprobs import (
    chat_logprobs,
    check_prompt_logprobs,
    check_top,
    completion_logprobs,
    logprob_options,
    prompt_logprobs,
)
from sgl.server.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    callers_names,
    chat_names,
    completion_names,
    sampling_dict,
    schedule_options,
    screen,
)
from sgl.server.reasoning import ReasoningPlan, ReasoningSplitter, format_of
from sgl.server.tool_calls import ChoiceTools, ToolPlan, message, plan, tool_schema


def finish_reason(fin: dict[str, Any] | None) -> str | None:
    return None if fin is None else fin["type"]


def matched_stop(fin: dict[str, Any] | None) -> int | str | None:
    """SGLang's matched_stop: the stop string or token id (EOS too) that ended a choice."""
    return fin.get("matched") if fin is not None and fin["type"] == "stop" else None


def end_fields(meta: dict[str, Any]) -> dict[str, Any]:
    fin = meta["finish_reason"]
    return {"finish_reason": finish_reason(fin), "matched_stop": matched_stop(fin)}


def check_model(state: ServerState, model: str | None) -> None:
    """A request naming another model is a 404, as vLLM answers it; no name means the served one."""
    if model is not None and model != state.model_name:
        raise _no_such_model(model)


def _no_such_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


async def adapter_of(state: ServerState, req: SamplingFields) -> str | None:
    """The LoRA adapter a request runs: `model` naming a loaded adapter (vLLM's way) or
    SGLang's `lora_path` (checked by the engine); None: the base model. A `model` that is
    neither the served name nor an adapter's is a 404; both fields naming different
    adapters a 400."""
    named = None
    if req.model is not None and req.model != state.model_name:
        if await state.engine.lora_adapter_path(req.model) is None:
            raise _no_such_model(req.model)
        named = req.model
    if named is not None and req.lora_path is not None and req.lora_path != named:
        raise ApiError(400, f"lora_path={req.lora_path!r} disagrees with model={named!r}: name the adapter in one "
                            "of them, or the same in both", "lora_path", "invalid_value")
    return named if named is not None else req.lora_path


def shown_model(state: ServerState, req: SamplingFields) -> str:
    """The `model` of a response: the name the caller gave (the base model's or an adapter's)."""
    return req.model if req.model is not None else state.model_name


def request_options(req: SamplingFields, adapter: str | None) -> dict[str, Any]:
    """The engine's options every OpenAI request may carry: scheduling, the adapter, a processor."""
    opts = schedule_options(req)
    if adapter is not None:
        opts["lora_path"] = adapter
    if req.custom_logit_processor is not None:
        opts["custom_logit_processor"] = req.custom_logit_processor
    return opts


def usage(groups: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """OpenAI usage from the meta_info of each prompt's samples: a prompt's tokens (and
    how many of them the radix cache held, from its first sample, which prefilled it:
    always reported, 0 included, as vLLM and OpenAI do) once, every sample's completion tokens."""
    p = sum(g[0]["prompt_tokens"] for g in groups)
    c = sum(m["completion_tokens"] for g in groups for m in g)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    out["prompt_tokens_details"] = {"cached_tokens": sum(g[0].get("cached_tokens") or 0 for g in groups)}
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


def _batch(prompts: list[tuple[str | None, list[int] | None]]) -> tuple[list[str] | None, list[list[int]] | None]:
    """A batch as the engine takes it: its texts or its id lists (_prompts gives one kind)."""
    texts, ids = [t for t, _ in prompts if t is not None], [i for _, i in prompts if i is not None]
    return texts or None, ids or None


def _check_completion(state: ServerState, req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported: this server does no fill-in-the-middle", "suffix")
    if req.best_of not in (None, 1):
        raise ApiError(400, f"best_of={req.best_of} is not supported: only best_of=1 (use n for several samples)",
                       "best_of")
    check_top(req.logprobs, "logprobs")
    check_prompt_logprobs(req.prompt_logprobs, req.stream)
    if (req.echo or req.logprobs is not None) and state.engine.tm.tok is None:
        name = "echo" if req.echo else "logprobs"
        raise ApiError(400, f"{name} needs a tokenizer, and this server runs with skip_tokenizer_init", name)


async def completions(state: ServerState, body: bytes) -> Response:
    req = decode_body(body, CompletionRequest)
    adapter = await adapter_of(state, req)
    screen(req)
    _check_completion(state, req)
    with callers_names(completion_names(req)):
        return await _completions(state, req, adapter)


async def _completions(state: ServerState, req: CompletionRequest, adapter: str | None) -> Response:
    sp = sampling_dict(req, req.max_tokens)
    prompts = _prompts(req.prompt)
    opts = {}
    if req.logprobs is not None or req.prompt_logprobs is not None:
        opts = logprob_options(req.logprobs or 0, req.echo and req.logprobs is not None, req.prompt_logprobs)
    opts.update(request_options(req, adapter))
    created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    if len(prompts) > 1 and req.rid is not None:
        raise ApiError(400, "rid: a batch of prompts takes no rid", "rid")
    if req.stream:
        return await _stream_completion(state, req, prompts, sp, opts, cid, created)
    per_prompt: Any  # a result (a list of n for n > 1) per prompt
    if len(prompts) == 1:
        per_prompt = [await state.engine.generate(prompts[0][0], sp, prompts[0][1], req.rid, **opts)]
    else:  # the engine's batch: a refused prompt is named and ends its siblings
        texts, ids = _batch(prompts)
        per_prompt = await state.engine.generate(texts, sp, ids, **opts)
    # With n > 1 each prompt gives a list of n samples: choice index = prompt index * n + sample.
    groups = [o if isinstance(o, list) else [o] for o in per_prompt]
    echoes = await _echoes(state, prompts) if req.echo else [""] * len(prompts)
    outs = [(echo, o) for echo, g in zip(echoes, groups) for o in g]
    choices = [{"index": k, "text": echo + o["text"],
                "logprobs": None if req.logprobs is None else completion_logprobs(o["meta_info"], req.echo, 0,
                                                                                 req.logprobs),
                **end_fields(o["meta_info"])} for k, (echo, o) in enumerate(outs)]
    if req.prompt_logprobs is not None:
        for choice, (_, o) in zip(choices, outs):
            choice["prompt_logprobs"] = prompt_logprobs(o["meta_info"], req.prompt_logprobs)
    return json_response({"id": cid, "object": "text_completion", "created": created,
                          "model": shown_model(state, req), "choices": choices,
                          "usage": usage([[o["meta_info"] for o in g] for g in groups])})


async def _stream_completion(state: ServerState, req: CompletionRequest,
                             prompts: list[tuple[str | None, list[int] | None]], sp: dict[str, Any],
                             opts: dict[str, Any], cid: str, created: int) -> Response:
    """One prompt's or a batch's choices, streamed interleaved; the engine numbers a
    batch's chunks prompt_index * n + sample_index, as the choices are numbered."""
    if len(prompts) == 1:
        chunks = await primed(state.engine.stream(prompts[0][0], sp, prompts[0][1], req.rid, **opts))
    else:
        texts, ids = _batch(prompts)
        chunks = await primed(state.engine.stream(texts, sp, ids, **opts))
    echoes = await _echoes(state, prompts) if req.echo else [""] * len(prompts)
    model = shown_model(state, req)
    offsets: dict[int, int] = {}  # each choice's text offset so far; absent before its first chunk

    def chunk(c: dict[str, Any]) -> dict[str, Any]:
        i = c.get("index", 0)
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(c["meta_info"], req.echo, offsets.get(i, 0))
        text = c["text"] if i in offsets else echoes[i // req.n] + c["text"]
        choice = {"index": i, "text": text, "logprobs": lp, **end_fields(c["meta_info"])}
        offsets[i] = offsets.get(i, 0) + (sum(map(len, lp["tokens"])) if lp else 0)
        return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}

    return _sse(_openai_stream(chunks, chunk, req, cid, "text_completion", created, model))


async def _echoes(state: ServerState, prompts: list[tuple[str | None, list[int] | None]]) -> list[str]:
    """Each prompt's text: as given, or its ids decoded by the tokenizer's process."""
    ids = [i for t, i in prompts if t is None and i is not None]
    decoded = iter(await decode(state.engine.tm.has_tokenizer("echo"), ids) if ids else [])
    return [t if t is not None else next(decoded) for t, _ in prompts]


async def chat_completions(state: ServerState, body: bytes) -> Response:
    req = decode_body(body, ChatRequest)
    adapter = await adapter_of(state, req)
    screen(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    check_top(req.top_logprobs, "top_logprobs")
    check_prompt_logprobs(req.prompt_logprobs, req.stream)
    with callers_names(chat_names(req)):
        return await _chat(state, req, adapter)


def _tool_plan(state: ServerState, req: ChatRequest, sp: dict[str, Any]) -> ToolPlan:
    """The request's tool plan; a forced choice becomes the json_schema the grammar enforces."""
    tp = plan(req.tools, req.tool_choice, req.parallel_tool_calls, getattr(state.engine.args, "tool_call_parser", None))
    schema = tool_schema(tp)
    if schema is not None:
        if other := next((k for k in ("json_schema", "regex", "ebnf") if k in sp), None):
            name = "response_format" if req.response_format is not None else other
            raise ApiError(400, f"tool_choice={tp.mode} cannot be combined with {name}: the tool's schema "
                                "constrains the output", "tool_choice", "invalid_value")
        sp["json_schema"] = schema
    if tp.parser == "mistral":
        sp.setdefault("skip_special_tokens", False)  # its calls start with the special token [TOOL_CALLS]
    return tp


async def _reasoning_plan(state: ServerState, req: ChatRequest, sp: dict[str, Any]) -> ReasoningPlan | None:
    """The request's reasoning plan, None without a parser; a grammar of a request that
    reasons starts after the end marker's token."""
    args = state.engine.args
    fmt = format_of(getattr(args, "reasoning_parser", None), getattr(args, "reasoning_markers", ()))
    if fmt is None:
        return None
    tok = state.engine.tm.tok
    if state.reasoning_marker_ids is None and tok is not None:
        state.reasoning_marker_ids = await encode(tok, [fmt.start, fmt.end], add_special_tokens=False)
    start_ids, end_ids = state.reasoning_marker_ids or ([], [])
    rp = ReasoningPlan(fmt, fmt.starts_inside(req.chat_template_kwargs), req.separate_reasoning is not False,
                       req.stream_reasoning is not False, start_ids, end_ids)
    if rp.inside and any(k in sp for k in ("json_schema", "regex", "ebnf")):
        if rp.end_id is None:
            raise ApiError(400, f"a grammar cannot start after the reasoning: its end marker {fmt.end!r} is not one "
                                "token of this model's tokenizer", "response_format", "invalid_value")
        sp["reasoning_end_id"] = rp.end_id
    return rp


def _with_reasoning(u: dict[str, Any], tokens: int | None) -> dict[str, Any]:
    if tokens is not None:
        u.setdefault("completion_tokens_details", {})["reasoning_tokens"] = tokens
    return u


def _reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    """A message's or a delta's reasoning, under SGLang's name and vLLM's."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


async def _chat(state: ServerState, req: ChatRequest, adapter: str | None) -> Response:
    sp = sampling_dict(req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens)
    tp = _tool_plan(state, req, sp)
    rp = await _reasoning_plan(state, req, sp)
    ids = req.input_ids
    if ids is None:  # the template, rendered in the tokenizer's process
        ids = await chat_prompt_ids(state.engine.tm.tok, req.messages, req.add_generation_prompt,
                                    req.continue_final_message, req.chat_template_kwargs, tp.tools)
    opts = {}
    if req.logprobs or req.prompt_logprobs is not None:
        opts = logprob_options(req.top_logprobs or 0 if req.logprobs else 0, False, req.prompt_logprobs)
    opts.update(request_options(req, adapter))
    created, cid, model = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}", shown_model(state, req)
    if req.stream:
        chunks = await primed(state.engine.stream(None, sp, ids, req.rid, **opts))
        seen: set[int] = set()
        tools: dict[int, ChoiceTools] = {}
        splitters: dict[int, ReasoningSplitter | None] = {}
        out_ids: dict[int, list[int]] = {}  # each choice's output ids so far (its reasoning tokens)

        def chunk(c: dict[str, Any]) -> dict[str, Any]:
            i, reason = c.get("index", 0), finish_reason(c["meta_info"]["finish_reason"])
            ct = tools.setdefault(i, ChoiceTools(tp))
            text, reasoning = c["text"], ""
            if (rs := splitters.setdefault(i, rp.splitter() if rp else None)) is not None:
                reasoning, text = rs.feed(text)
                if reason is not None:
                    r2, t2 = rs.finish()
                    reasoning, text = reasoning + r2, text + t2
            out_ids.setdefault(i, []).extend(c.get("output_ids") or [])
            content, calls = ct.feed(text)
            if reason is not None:
                more, calls2 = ct.finish()
                content, calls = content + more, calls + calls2
            delta: dict[str, Any] = {"content": content} if content or not (calls or reasoning) else {}
            if reasoning:
                delta.update(_reasoning_fields(reasoning))
            if calls:
                delta["tool_calls"] = calls
            if i not in seen:  # each choice's first delta names the role
                delta["role"] = "assistant"
                seen.add(i)
            choice = {"index": i, "delta": delta,
                      "logprobs": chat_logprobs(c["meta_info"], req.top_logprobs or 0) if req.logprobs else None,
                      **end_fields(c["meta_info"]), "finish_reason": ct.finish_reason(reason)}
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice]}

        def reasoning_tokens() -> int | None:
            return None if rp is None else sum(map(rp.tokens, out_ids.values()))

        return _sse(_openai_stream(chunks, chunk, req, cid, "chat.completion.chunk", created, model,
                                   reasoning_tokens))
    res = await state.engine.generate(None, sp, ids, req.rid, **opts)
    outs = res if isinstance(res, list) else [res]
    choices = []
    for k, o in enumerate(outs):
        reasoning, text = rp.split(o["text"]) if rp else (None, o["text"])
        msg, reason = message(tp, text, finish_reason(o["meta_info"]["finish_reason"]))
        if rp is not None and rp.separate:
            msg.update(_reasoning_fields(reasoning))
        choices.append({"index": k, "message": msg,
                        "logprobs": chat_logprobs(o["meta_info"], req.top_logprobs or 0) if req.logprobs else None,
                        **end_fields(o["meta_info"]), "finish_reason": reason})
    u = _with_reasoning(usage([[o["meta_info"] for o in outs]]),
                        None if rp is None else sum(rp.tokens(o.get("output_ids") or []) for o in outs))
    body = {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": u}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(outs[0]["meta_info"], req.prompt_logprobs)
    return json_response(body)


async def _openai_stream(chunks: AsyncIterator[dict[str, Any]], shape: Any, req: SamplingFields, cid: str, obj: str,
                         created: int, model: str,
                         reasoning_tokens: Callable[[], int | None] = lambda: None) -> AsyncIterator[dict[str, Any]]:
    last: dict[int, dict[str, Any]] = {}  # each choice's latest meta_info
    async for c in chunks:
        last[c.get("index", 0)] = c["meta_info"]
        out = shape(c)
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            out["usage"] = _with_reasoning(_stream_usage(last, req.n), reasoning_tokens())
        yield out
    if last and req.stream_options is not None and req.stream_options.include_usage:
        yield {"id": cid, "object": obj, "created": created, "model": model, "choices": [],
               "usage": _with_reasoning(_stream_usage(last, req.n), reasoning_tokens())}


def _stream_usage(last: dict[int, dict[str, Any]], n: int) -> dict[str, Any]:
    """The usage so far of the choices seen; choice i belongs to prompt i // n."""
    per_prompt: dict[int, list[dict[str, Any]]] = {}
    for i, m in sorted(last.items()):
        per_prompt.setdefault(i // n, []).append(m)
    return usage(list(per_prompt.values()))


def _sse(events: AsyncIterator[dict[str, Any]]) -> Response:
    return StreamingResponse(sse_stream(events), media_type="text/event-stream", headers=SSE_HEADERS)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": int(state.started_wall), "owned_by": "sgl",
            "root": state.model_name, "parent": None, "max_model_len": state.engine.info["context_length"]}


def _adapter_card(state: ServerState, name: str, path: str) -> dict[str, Any]:
    """A loaded LoRA adapter, as vLLM lists one: its folder as root, the base model as parent."""
    return {"id": name, "object": "model", "created": int(state.started_wall), "owned_by": "sgl", "root": path,
            "parent": state.model_name, "max_model_len": state.engine.info["context_length"]}


def models(state: ServerState) -> Response:
    """The base model, then each adapter this server knows to be loaded, in the order they were loaded."""
    adapters = [_adapter_card(state, name, path) for name, path in state.engine.loras.listed().items()]
    return json_response({"object": "list", "data": [_model_card(state), *adapters]})


async def model(state: ServerState, model_id: str) -> Response:
    if model_id == state.model_name:
        return json_response(_model_card(state))
    path = await state.engine.lora_adapter_path(model_id)
    if path is None:
        raise _no_such_model(model_id)
    return json_response(_adapter_card(state, model_id, path))
