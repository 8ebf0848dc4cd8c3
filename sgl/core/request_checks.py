"""The value checks a request must pass, in one place for the two sides that make
them: the tokenizer manager raises the message as a ValueError when a request is
submitted, and the scheduler aborts with the same message a request that reached it
without that check (a client attached over tcp). Every message starts with the
field it is about.

Types are not checked here: the tokenizer manager checks the user's input first,
and the scheduler receives decoded msgspec structs. Nothing here reads engine
state: each side passes its limits."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sgl.core.logit_processor import check_allowed
from sgl.core.sampling_params import INT64_MAX, MAX_BEAM_WIDTH, SamplingParams
from sgl.core.server_args import MAX_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    context_length: int
    max_total_tokens: int  # KV slots in all: a longer prompt can never run
    has_tokenizer: bool  # stop strings are matched on text
    allowed_processors: tuple[str, ...] = ()
    max_top_logprobs_num: int = 20  # OpenAI's bound; ServerArgs.max_top_logprobs_num
    max_running_requests: int = MAX_BEAM_WIDTH  # request rows: a beam request takes beam_width of them


MAX_TOKEN_IDS_LOGPROB = 256


def limits_of(info: Mapping[str, Any], has_tokenizer: bool, allowed_processors: Sequence[str] | None) -> RequestLimits:
    """The limits of the scheduler that reported `info` (its get_server_info)."""
    return RequestLimits(info["vocab_size"], info["context_length"], info["max_total_tokens"], has_tokenizer,
                         tuple(allowed_processors or ()), info.get("max_top_logprobs_num", 20),
                         info.get("max_running_requests", MAX_BEAM_WIDTH))


def request_error(
    ids: Sequence[int], params: SamplingParams, logprob_start_len: int, top_logprobs_num: int,
    token_ids_logprob: Sequence[int] | None, processor: str | None, limits: RequestLimits,
    return_logprob: bool = False, priority: int = 0, timeout: float | None = None,
) -> str | None:
    """Why the request cannot run, or None."""
    if (error := schedule_error(priority, timeout)) is not None:
        return error
    n, v = len(ids), limits.vocab_size
    if n == 0:
        return "input_ids: empty input: a request needs at least one token"
    if (bad := out_of_vocab("input_ids", ids, v)) is not None:
        return bad
    if n >= limits.context_length:
        return (f"input_ids: {context_message(limits.context_length)} However, your request has {n} input tokens, "
                "which leave no room for a completion. Please reduce the length of the messages or prompt.")
    if n + 1 > limits.max_total_tokens:
        return f"input_ids: {n} tokens can never fit the KV cache, which holds {limits.max_total_tokens}"
    # A request that could never finish is refused now, not after it filled the cache (vLLM and SGLang alike).
    m = params.max_new_tokens
    if n + m > limits.context_length:
        return (f"max_new_tokens={m} is too large: {context_message(limits.context_length)} However, you requested "
                f"{n + m} tokens ({n} in the messages, {m} in the completion). Please reduce the length of the "
                "messages or completion.")
    if n + m > limits.max_total_tokens:
        return (f"max_new_tokens={m} is invalid: the prompt's {n} tokens plus {m} new ones can never fit the KV "
                f"cache, which holds {limits.max_total_tokens} tokens ({n + m - limits.max_total_tokens} too many)")
    if params.beam_width and (error := beam_error(n, params, limits, return_logprob)) is not None:
        return error
    for name, toks in (("stop_token_ids", params.stop_token_ids), ("token_ids_logprob", token_ids_logprob or ())):
        if (bad := out_of_vocab(name, toks, v)) is not None:
            return bad
    if (key := next((k for k in params.logit_bias if not 0 <= k < v), None)) is not None:
        return f"logit_bias: token id {key} is out of the vocabulary (size {v})"
    if params.reasoning_end_id is not None and params.reasoning_end_id >= v:  # never < 0: SamplingParams
        return f"reasoning_end_id={params.reasoning_end_id} is out of the vocabulary (size {v})"
    c = params.constraint
    if c is not None and c.sequences is not None and max(map(max, c.sequences)) >= v:  # none < 0: SamplingParams
        return f"constraint.sequences: ids must lie in [0, {v})"
    if not -1 <= logprob_start_len < n:
        return f"logprob_start_len={logprob_start_len} is invalid: must be -1 or in [0, {n})"
    if not 0 <= top_logprobs_num <= limits.max_top_logprobs_num:
        return f"top_logprobs_num={top_logprobs_num} is invalid: must be in [0, {limits.max_top_logprobs_num}]"
    if token_ids_logprob is not None and len(token_ids_logprob) > MAX_TOKEN_IDS_LOGPROB:
        return f"token_ids_logprob: at most {MAX_TOKEN_IDS_LOGPROB} ids, got {len(token_ids_logprob)}"
    if params.stop_strs and not limits.has_tokenizer:
        return "stop: stop strings need a tokenizer, and this engine runs with skip_tokenizer_init"
    if params.stop_regex and not limits.has_tokenizer:
        return "stop_regex: regex stops need a tokenizer, and this engine runs with skip_tokenizer_init"
    if processor is not None:
        try:
            check_allowed(processor, list(limits.allowed_processors))
        except ValueError as e:
            return str(e)
    return None


def refield(message: str, names: Mapping[str, str]) -> str:
    """`message` with its leading field renamed (names: field -> what to call it) where it
    leads with one of them ("input_ids[3]=9 ...", "prompt: ..."); as it was otherwise."""
    lead = re.compile(rf"^({'|'.join(map(re.escape, names))})(?=[\[:=])")
    return lead.sub(lambda m: names[m.group(1)], message, count=1)


def context_message(context_length: int) -> str:
    """The sentence OpenAI and vLLM open a context overflow with; clients (LiteLLM, LangChain)
    recognise the error by it."""
    return f"This model's maximum context length is {context_length} tokens."


def out_of_vocab(name: str, ids: Sequence[int], vocab_size: int) -> str | None:
    """The first id of `ids` outside the vocabulary, named with its position, or None."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    k = next(k for k, t in enumerate(ids) if not 0 <= t < vocab_size)
    return f"{name}[{k}]={ids[k]} is out of the vocabulary (size {vocab_size})"


def schedule_error(priority: int, timeout: float | None) -> str | None:
    """Why a request's priority or timeout (seconds) is out of range, or None."""
    if not -INT64_MAX <= priority <= INT64_MAX:
        return f"priority={priority} is invalid: must be a 64-bit integer"
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:  # NaN fails too
        return f"timeout={timeout} is invalid: must be in (0, {MAX_TIMEOUT_S:g}] seconds"
    return None


def beam_error(n: int, params: SamplingParams, limits: RequestLimits, return_logprob: bool) -> str | None:
    """Why a beam-search request (beam_width >= 1) of an `n`-token prompt cannot run, or None."""
    w, m = params.beam_width, params.max_new_tokens
    if w > limits.max_running_requests:
        return (f"beam_width={w} is invalid: each beam takes a request row, and the scheduler runs at most "
                f"max_running_requests={limits.max_running_requests}")
    if n + w * m > limits.max_total_tokens:
        return (f"beam_width={w} is invalid: the prompt's {n} tokens plus {w} beams of max_new_tokens={m} can "
                f"never fit the KV cache, which holds {limits.max_total_tokens} tokens "
                f"({n + w * m - limits.max_total_tokens} too many)")
    if return_logprob:
        return "return_logprob: not supported with beam_width; each beam carries cumulative_logprob"
    return None
