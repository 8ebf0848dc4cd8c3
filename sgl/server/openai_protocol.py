"""The OpenAI routes' request bodies, what becomes of each field, and the
sampling dict the engine gets from them.

Every field of OpenAI's request schema, and of SGLang's extras, is declared, so
that a field neither defines stays a 400 (`forbid_unknown_fields`). A declared
field is either used, or accepted and ignored where it cannot change the output
(IGNORED: `store`, `metadata`, `user`, ...; one debug log line names them), or
refused with a 400 "not supported yet" where ignoring it would hand back
something the caller did not ask for (REFUSED: the deprecated functions /
function_call, session_id, hidden states, ...). The LoRA adapter is `model` naming one, or
SGLang's `lora_path` (openai_api resolves them). Structured output (response_format,
SGLang's regex / json_schema / ebnf, vLLM's structured_outputs and guided_*) becomes
the sampling fields the grammar backend enforces; tools, tool_choice and parallel_tool_calls are server/tool_calls'.
Errors raised below the route (SamplingParams, the request checks) are given back
in the caller's names: `max_tokens`, not `sampling_params.max_new_tokens`. No
engine is called here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from sgl.core.log import get_logger
from sgl.server.common import ApiError, code_of, invalid

log = get_logger("http")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields both endpoints take: OpenAI's, then SGLang's (and vLLM's beam) extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
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
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None
    # Beam search: vLLM's use_beam_search (n beams), or beam_width itself (n: how many to return).
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    # Scheduling (the engine's options): SGLang's priority (higher first; vLLM takes the
    # field too, lower first there), and a deadline in seconds from the scheduler's receipt.
    priority: int | None = None
    timeout: float | None = None
    # SGLang's: the LoRA adapter (its name) that runs the request, as `model` naming it does.
    lora_path: str | None = None
    # Accepted and ignored: they cannot change what comes back.
    user: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    custom_labels: Any = None
    routed_dp_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    data_parallel_rank: Any = None
    ngram_corpus_id: Any = None
    images_config: Any = None
    return_cached_tokens_details: Any = None
    routed_experts_start_len: Any = None
    stop_regex: Any = None  # SGLang's regex stops (SamplingParams checks them)
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs with this many alternatives
    # Structured output (grammar_fields), and vLLM's names for it.
    response_format: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Refused when set: not implemented (yet).
    session_id: Any = None
    session_params: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    return_token_ids: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One message. Any role is taken (a custom one is the template's to render, as vLLM
    passes it); keys no field declares are kept in `extra` and reach the template too."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls: the template shows them
    tool_call_id: str | None = None  # a tool message's answer to one
    reasoning_content: str | None = None
    refusal: str | None = None
    function_call: dict[str, Any] | None = None  # OpenAI's deprecated form of tool_calls
    audio: Any = None  # a reference to an earlier audio answer: ignored
    extra: dict[str, Any] = {}

    @classmethod
    def parse(cls, raw: list[dict[str, Any]]) -> list[ChatMessage]:
        """The request's messages (JSON objects), each checked; an error names messages[k]."""
        out = []
        for k, m in enumerate(raw):
            declared = {f: v for f, v in m.items() if f in cls.__struct_fields__ and f != "extra"}
            try:
                msg = msgspec.convert(declared, cls)
            except msgspec.ValidationError as e:
                raise ApiError(400, f"messages[{k}]: {e}", "messages", code_of(str(e))) from None
            if not msg.role:
                raise ApiError(400, f"messages[{k}].role is empty", "messages", "invalid_value")
            msg.extra = {f: v for f, v in m.items() if f not in declared}
            out.append(msg)
        return out


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]  # ChatMessage.parse: unknown keys are the template's
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    input_ids: list[int] | None = None  # SGLang: the prompt's ids, in place of the rendered messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's, with a --reasoning-parser (server/reasoning): split the reasoning out (default
    # true), stream it as it comes (default true; false: whole, once it ends).
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    modalities: list[str] | None = None  # only ["text"]
    # Accepted and ignored.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None  # no model here reasons
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    verbosity: Any = None
    prediction: Any = None
    task: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    use_audio_in_video: Any = None
    # Tool calling (server/tool_calls).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # Refused when set.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    return_prompt_token_ids: Any = None
    return_meta_info: Any = None


IGNORED = ("user", "extra_key", "cache_salt", "custom_labels", "routed_dp_rank",
           "disagg_prefill_dp_rank", "data_parallel_rank", "ngram_corpus_id", "images_config",
           "return_cached_tokens_details", "routed_experts_start_len", "store", "metadata", "service_tier",
           "reasoning_effort", "prompt_cache_key", "safety_identifier", "verbosity", "prediction",
           "task", "max_dynamic_patch", "min_dynamic_patch",
           "use_audio_in_video")
_FUNCTIONS = "OpenAI's deprecated function calling: use tools and tool_choice"
REFUSED = {"functions": _FUNCTIONS, "function_call": _FUNCTIONS,
           "session_id": "sessions are not implemented",
           "session_params": "sessions are not implemented", "audio": "this server makes no audio",
           "web_search_options": "this server searches nothing",
           "bootstrap_host": "this server runs no prefill/decode disaggregation",
           "bootstrap_port": "this server runs no prefill/decode disaggregation",
           "bootstrap_room": "this server runs no prefill/decode disaggregation"}
# Refused only when true: asking for an output this server does not return.
REFUSED_IF_TRUE = ("return_hidden_states", "return_routed_experts", "return_token_ids", "return_prompt_token_ids",
                   "return_meta_info")


def schedule_options(req: SamplingFields) -> dict[str, Any]:
    """The engine's scheduling options the request gave (priority, timeout)."""
    return {name: v for name in ("priority", "timeout") if (v := getattr(req, name)) is not None}


def screen(req: SamplingFields) -> None:
    """Refuse the fields this server cannot honour, log the ones it ignores."""
    if getattr(req, "stream_options", None) is not None and not req.stream:
        # OpenAI's and vLLM's answer: the options describe a stream that was not asked for.
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options", "invalid_value")
    for name, why in REFUSED.items():
        if getattr(req, name, None) is not None:
            raise ApiError(400, f"{name} is not supported yet: {why}", name, "unsupported_parameter")
    for name in REFUSED_IF_TRUE:
        if getattr(req, name, None) not in (None, False):
            raise ApiError(400, f"{name} is not supported yet: this server does not return it", name,
                           "unsupported_parameter")
    modalities = getattr(req, "modalities", None)
    if modalities is not None and set(modalities) - {"text"}:
        raise ApiError(400, f"modalities={modalities} is not supported yet: this server makes text only",
                       "modalities", "unsupported_parameter")
    ignored = [name for name in IGNORED if getattr(req, name, None) is not None]
    if ignored:
        log.debug("request fields accepted and ignored", fields=",".join(ignored))


# A field that equals its neutral value is left out, so a client sending OpenAI's
# defaults never trips on a field the sampler does not know.
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
_PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "stop_token_ids", "ignore_eos", "skip_special_tokens",
           "spaces_between_special_tokens", "no_stop_trim", "length_penalty", "early_stopping", "custom_params",
           "stop_regex", *_NEUTRAL)


def sampling_dict(req: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
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
    sp.update(grammar_fields(req))
    return sp


def grammar_fields(req: SamplingFields) -> dict[str, Any]:
    """Structured output: SGLang's regex / json_schema / ebnf, or OpenAI's response_format
    (text; json_object: any JSON object; json_schema: its schema, strict or not, since the
    grammar enforces the schema either way)."""
    out: dict[str, Any] = {}
    for name in ("regex", "ebnf", "json_schema"):
        v = getattr(req, name, None)
        if v is None:
            continue
        if name == "json_schema" and isinstance(v, dict):
            v = json.dumps(v)
        if not isinstance(v, str):
            raise ApiError(400, f"{name} must be a string" + (" or an object" if name == "json_schema" else ""), name,
                           "invalid_type")
        out[name] = v
    for name, value in vllm_grammar(req).items():
        if out:
            raise ApiError(400, f"{name} cannot be combined with {next(iter(out))}", name, "invalid_value")
        out = {value[0]: value[1]}
    rf = getattr(req, "response_format", None)
    if rf is None:
        return out
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return out
    if out:
        raise ApiError(400, f"response_format cannot be combined with {next(iter(out))}", "response_format",
                       "invalid_value")
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema must be an object with a 'schema' object",
                           "response_format", "invalid_value")
        return {"json_schema": json.dumps(schema)}
    raise ApiError(400, f"response_format.type={kind!r} is invalid: must be text, json_object or json_schema",
                   "response_format", "invalid_value")


# vLLM's structured_outputs keys (and its older guided_* fields) -> the grammar kind each becomes.
_VLLM_GRAMMAR = {"json": "json_schema", "regex": "regex", "choice": "regex", "grammar": "ebnf",
                 "json_object": "json_schema"}


def vllm_grammar(req: SamplingFields) -> dict[str, tuple[str, str]]:
    """vLLM's structured output: the caller's field name -> (grammar kind, text)."""
    asked: dict[str, tuple[str, Any]] = {}
    so = req.structured_outputs
    for key, value in (so or {}).items():
        if key not in _VLLM_GRAMMAR:
            if value in (None, False):
                continue
            raise ApiError(400, f"structured_outputs.{key} is not supported yet: json, regex, choice, grammar and "
                                "json_object are", "structured_outputs", "unsupported_parameter")
        if value is not None and not (key == "json_object" and value is False):
            asked[f"structured_outputs.{key}"] = (key, value)
    for key in ("json", "regex", "choice", "grammar"):
        if (value := getattr(req, f"guided_{key}")) is not None:
            asked[f"guided_{key}"] = (key, value)
    if len(asked) > 1:
        a, b = list(asked)[:2]
        raise ApiError(400, f"{a} cannot be combined with {b}: one constraint per request", a, "invalid_value")
    return {name: (_VLLM_GRAMMAR[key], _grammar_text(name, key, value)) for name, (key, value) in asked.items()}


_REGEX_SPECIAL = re.compile(r"[\\.^$|?*+()\[\]{}]")


def _grammar_text(name: str, key: str, value: Any) -> str:
    if key == "json_object":
        return json.dumps({"type": "object"})
    if key == "json" and isinstance(value, dict):
        return json.dumps(value)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ApiError(400, f"{name} must be a non-empty list of strings", name, "invalid_type")
        return "|".join(_REGEX_SPECIAL.sub(r"\\\g<0>", c) for c in value)
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string" + (" or an object" if key == "json" else ""), name,
                       "invalid_type")
    return value


def beam_fields(req: SamplingFields) -> dict[str, Any]:
    """The sampling fields of a beam-search request, which returns n choices, best first."""
    if req.stream:
        raise ApiError(400, "stream=true is not supported with beam search: the beams come back once they finish",
                       "stream")
    if getattr(req, "logprobs", None) not in (None, False):
        raise ApiError(400, "logprobs is not supported with beam search (each beam has its cumulative logprob)",
                       "logprobs")
    if req.beam_width is not None and req.beam_width < 0:
        raise ApiError(400, f"beam_width={req.beam_width} is invalid: must be >= 1 (or unset: n beams)", "beam_width")
    width = req.beam_width or req.n
    if req.n > width:
        raise ApiError(400, f"n={req.n} is invalid: at most beam_width={width} beams can be returned", "n")
    return {"beam_width": width, "num_return_beams": req.n}


def completion_names(req: CompletionRequest) -> dict[str, str]:
    """The caller's names for the engine's fields, in a completion request."""
    return {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "input_ids": "prompt",
            "top_logprobs_num": "logprobs", **_schema_name(req)}


def chat_names(req: ChatRequest) -> dict[str, str]:
    return {"max_new_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
            "min_new_tokens": "min_tokens", "input_ids": "input_ids" if req.input_ids is not None else "messages",
            "top_logprobs_num": "top_logprobs", **_schema_name(req)}


def _schema_name(req: SamplingFields) -> dict[str, str]:
    """The caller's field the engine's json_schema came from: response_format, or the tools
    a forced tool_choice constrains the output to (grammar_fields, openai_api's tool plan)."""
    if getattr(req, "response_format", None) is not None:
        return {"json_schema": "response_format"}
    if getattr(req, "tools", None) and getattr(req, "tool_choice", None) not in (None, "auto", "none"):
        return {"json_schema": "tools"}
    return {}


_SAMPLING_PREFIX = re.compile(r"^sampling_params: |\bsampling_params\.")


def in_callers_names(message: str, names: dict[str, str]) -> str:
    """`message` with the engine's field names replaced by the request's."""
    message = _SAMPLING_PREFIX.sub("", message)
    for engine_name, caller_name in names.items():
        message = re.sub(rf"\b{engine_name}\b", caller_name, message)
    return message


@contextmanager
def callers_names(names: dict[str, str]) -> Iterator[None]:
    """Invalid input found below the route (a ValueError) becomes a 400 in the caller's names."""
    try:
        yield
    except ApiError:
        raise
    except ValueError as e:
        raise invalid(in_callers_names(str(e), names)) from None
