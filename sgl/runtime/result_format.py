"""The parts of a result dict the scheduler's numbers become, in SGLang's shapes:
a chunk's logprobs as (logprob, token_id, text) triples, and a beam request's beams
as a list of result dicts.

Pure formatting of what the scheduler computed: token texts are looked up in the
vocabulary's texts (each id decoded alone, by the tokenizer's process); it never
computes, reorders or drops a logprob or a beam."""

from __future__ import annotations

from typing import Any

from sgl.core.protocol import Beam, Logprobs
from sgl.runtime.req_options import ReqOptions

BEAM_STREAM_ERROR = "stream=True is invalid with beam_width: the beams come back together once they finish"

# A chunk's logprob lists in its meta_info: deltas, as its text and ids are, so chunks join
# by concatenating them; every other meta_info field is the stream's state so far.
LOGPROB_KEYS = ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs", "input_top_logprobs",
                "output_token_ids_logprobs", "input_token_ids_logprobs")


def join_chunks(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """One stream chunk of `first`'s tokens then `later`'s (the next chunk of the same
    stream): texts, ids and logprob lists joined, the other meta_info fields as `later`
    has them (counts so far, the finish). `later` is changed and returned."""
    meta, before = later["meta_info"], first["meta_info"]
    for key in LOGPROB_KEYS:
        if key in before:
            meta[key] = before[key] + meta.get(key, [])
    later["text"] = first["text"] + later["text"]
    later["output_ids"] = first["output_ids"] + later["output_ids"]
    return later


def beam_results(beams: list[Beam] | None, final: dict[str, Any]) -> list[dict[str, Any]]:
    """The beams of the request whose final dict is `final`. A request that ended
    without beams (aborted before any finished) gives its final dict alone, as beam 0."""
    meta = final["meta_info"]
    if not beams:
        meta.update(cumulative_logprob=None, score=None, beam_index=0)
        return [final]
    return [{"text": b.text, "output_ids": b.output_ids, "meta_info": {
        **meta, "finish_reason": b.finish_reason, "completion_tokens": len(b.output_ids),
        "cumulative_logprob": b.cumulative_logprob, "score": b.score, "beam_index": k}}
        for k, b in enumerate(beams)]


def format_logprobs(lp: Logprobs, new_ids: list[int], opts: ReqOptions,
                    vocab: list[str] | None) -> dict[str, list[Any]]:
    """SGLang's meta_info lists of (logprob, token_id, text) triples; text is None unless
    return_text_in_logprobs (and a tokenizer: `vocab`, each id's text)."""
    named = opts.return_text_in_logprobs and vocab is not None
    size = len(vocab) if vocab is not None else 0

    def name(t: int) -> str | None:
        return vocab[t] if named and 0 <= t < size else None  # type: ignore[index]

    def triples(vals: list[Any], ids: list[int]) -> list[tuple[Any, int, str | None]]:
        return [(v, t, name(t)) for v, t in zip(vals, ids)]

    def rows(vals: list[Any], ids: list[Any]) -> list[Any]:
        return [None if v is None else triples(v, t) for v, t in zip(vals, ids)]

    out = {"output_token_logprobs": triples(lp.output_vals, new_ids),
           "input_token_logprobs": triples(lp.input_vals, lp.input_ids)}
    if opts.top_logprobs_num:
        out["output_top_logprobs"] = rows(lp.output_top_vals, lp.output_top_ids)
        out["input_top_logprobs"] = rows(lp.input_top_vals, lp.input_top_ids)
    if opts.token_ids_logprob:
        req_ids = opts.token_ids_logprob
        out["output_token_ids_logprobs"] = rows(lp.output_ids_vals, [req_ids] * len(lp.output_ids_vals))
        out["input_token_ids_logprobs"] = rows(lp.input_ids_vals, [req_ids] * len(lp.input_ids_vals))
    return out
