"""The arguments of a generate or stream call that describe a batch: splitting a
batch call into per-prompt items, per-prompt options, the chunk index offsets
of a streamed batch, and a prompt's refusal naming its position. Nothing here
touches an engine."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import fields
from typing import Any

from sgl.core.request_checks import refield
from sgl.core.sampling_params import SamplingParams
from sgl.runtime.req_options import ReqOptions
from sgl.runtime.result_format import BEAM_STREAM_ERROR


def split_batch(prompt: Any, input_ids: Any, sp: Any, rid: Any) -> list[tuple[Any, Any, Any, Any]] | None:
    """Per-item arguments when the call is a batch, None when it is one request. Every
    engine call comes through here first: it takes its prompts as text or as ids, never
    both (a batch of texts would otherwise drop the ids unread)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("prompt: give exactly one of prompt or input_ids")
    if isinstance(prompt, list):
        n, prompts, ids = len(prompt), prompt, [None] * len(prompt)
    elif isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        n, prompts, ids = len(input_ids), [None] * len(input_ids), input_ids
    else:
        return None
    if n == 0:
        raise ValueError("prompt: an empty batch")
    sps = sp if isinstance(sp, list) else [sp] * n
    rids = rid if isinstance(rid, list) else [None] * n if rid is None else None
    if rids is None:
        raise ValueError("rid: a batch needs a list of rids, one per prompt")
    if len(sps) != n or len(rids) != n:
        raise ValueError(f"sampling_params/rid: a batch of {n} needs {n} of each")
    seen: set[str] = set()
    for r in rids:
        if isinstance(r, str):  # any other type is refused as the request is sent
            if r in seen:
                raise ValueError(f"rid: the batch names {r!r} twice: each prompt needs a rid of its own")
            seen.add(r)
    return list(zip(prompts, ids, sps, rids))


def name_item(e: ValueError, i: int) -> None:
    """Make a batch's refusal of its prompt i name it, in place (its type and attributes
    kept, for the caller to raise again): "input_ids[0]=9 ..." becomes "input_ids[i][0]=9 ..."."""
    if e.args and isinstance(e.args[0], str):
        e.args = (refield(e.args[0], {"prompt": f"prompt[{i}]", "input_ids": f"input_ids[{i}]"}), *e.args[1:])


def item_call(i: int, call: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """`call` for prompt i of a batch: a refusal names the prompt (name_item)."""
    async def named() -> Any:
        try:
            return await call()
        except ValueError as e:
            name_item(e, i)
            raise
    return named


async def item_stream(i: int, gen: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
    """The stream of prompt i of a batch: a refusal names the prompt (name_item);
    closing it closes `gen` (which sends its abort)."""
    try:
        async for chunk in gen:
            yield chunk
    except ValueError as e:
        name_item(e, i)
        raise
    finally:
        await gen.aclose()


def index_offsets(sps: list[Any]) -> list[int]:
    """The first chunk index of each prompt of a streamed batch: the samples before it."""
    offsets, total = [], 0
    for sp in sps:
        offsets.append(total)
        total += SamplingParams.coerce(sp).n
    return offsets


_OPTION_NAMES = frozenset(f.name for f in fields(ReqOptions))


def options_of(options: dict[str, Any]) -> ReqOptions:
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown argument of generate (known: {sorted(_OPTION_NAMES)})")
    return ReqOptions(**options)


def batch_options(options: dict[str, Any], n: int) -> list[ReqOptions]:
    """Per-prompt options: a list value gives one per prompt (token_ids_logprob: a list of lists)."""
    per: list[dict[str, Any]] = [{} for _ in range(n)]
    for k, v in options.items():
        per_item = isinstance(v, list) and (k != "token_ids_logprob" or (v and isinstance(v[0], list)))
        if per_item and len(v) != n:
            raise ValueError(f"{k}: a batch of {n} needs {n} values, got {len(v)}")
        for i in range(n):
            per[i][k] = v[i] if per_item else v
    return [options_of(o) for o in per]


def check_stream_args(prompt: Any, sp: Any, input_ids: Any, rid: Any, options: dict[str, Any]) -> None:
    """The checks of `AsyncEngine.stream` that need no engine: batch shape, option names,
    and no beam search (a beam request never streams)."""
    items = split_batch(prompt, input_ids, sp, rid)
    if items is None:
        options_of(options)
    else:
        batch_options(options, len(items))
    for s in [it[2] for it in items] if items is not None else [sp]:
        if s.get("beam_width") if isinstance(s, dict) else getattr(s, "beam_width", 0):
            raise ValueError(BEAM_STREAM_ERROR)


def one_request(prompt: Any, input_ids: Any, rid: Any) -> tuple[str | None, list[int] | None, str | None]:
    """The arguments of a call that `split_batch` found not to be a batch, typed as one
    request takes them (the tokenizer manager checks their values)."""
    return prompt, input_ids, rid
