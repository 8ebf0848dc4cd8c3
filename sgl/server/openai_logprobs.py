"""OpenAI's logprob shapes from the engine's (logprob, id, text) triples, each token
decoded on its own: completions get the legacy lists (`echo` adds the prompt's,
the first one null), chat gets `content` entries; a streamed chunk carries its
own tokens'. Pure formatting: it calls no engine."""

from __future__ import annotations

from typing import Any

from sgl.server.common import ApiError

MAX_LOGPROBS = 20  # the most top logprobs a position may ask for (vLLM's default max_logprobs)


def check_top(value: int | None, name: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{name}={value} is invalid: must be in [0, {MAX_LOGPROBS}]", name)


def check_prompt_logprobs(value: int | None, stream: bool) -> None:
    """vLLM's rules for prompt_logprobs: a count as top_logprobs', never with a stream."""
    check_top(value, "prompt_logprobs")
    if value is not None and stream:
        raise ApiError(400, "prompt_logprobs is not available with stream=true", "prompt_logprobs")


def logprob_options(top: int, prompt: bool, prompt_top: int | None = None) -> dict[str, Any]:
    """The engine's request options for logprobs with `top` alternatives per position,
    of the prompt's tokens too if `prompt` or vLLM's `prompt_top` (prompt_logprobs) is
    set; the engine gives every position the larger count (the formatters cut)."""
    return {"return_logprob": True, "top_logprobs_num": max(top, prompt_top or 0), "return_text_in_logprobs": True,
            "logprob_start_len": 0 if prompt or prompt_top is not None else -1}


def prompt_logprobs(meta: dict[str, Any], top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt position (the first null) the prompt's token and
    the `top` likeliest, by id, each with its logprob, rank (1 = likeliest; null for a
    prompt token outside the top ones, whose rank the engine does not report) and text."""
    out: list[dict[str, dict[str, Any]] | None] = []
    tops = meta.get("input_top_logprobs") or [None] * len(meta["input_token_logprobs"])
    for (v, tid, text), row in zip(meta["input_token_logprobs"], tops):
        if v is None:
            out.append(None)
            continue
        row = (row or [])[:top]
        entry = {str(t): {"logprob": x, "rank": k + 1, "decoded_token": s} for k, (x, t, s) in enumerate(row)}
        entry.setdefault(str(tid), {"logprob": v, "rank": None, "decoded_token": text})
        out.append(entry)
    return out


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


def completion_logprobs(meta: dict[str, Any], prompt: bool, offset: int, top: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs. `offset`: the text offset of the first token. Offsets add
    up the token strings' lengths, so they drift from the text where the detokenizer
    drops (special) or merges (split UTF-8) what single-token decoding shows."""
    toks, tops = _rows(meta, prompt)
    if top is not None:  # the engine gave more alternatives, for prompt_logprobs
        tops = [None if row is None else row[:top] for row in tops]
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


def chat_logprobs(meta: dict[str, Any], top: int | None = None) -> dict[str, Any]:
    toks, tops = _rows(meta, prompt=False)
    if top is not None:
        tops = [None if row is None else row[:top] for row in tops]
    return {"content": [{**_chat_token(t), "top_logprobs": [_chat_token(x) for x in row or ()]}
                        for t, row in zip(toks, tops)]}


def _chat_token(t: Triple) -> dict[str, Any]:
    # The bytes of the token's own decoding: a token holding part of a UTF-8 character shows as U+FFFD.
    return {"token": t[2], "logprob": t[0], "bytes": list(t[2].encode())}
