"""The logprobs of one output chunk in SGLang's meta_info shape: lists of
(logprob, token_id, text) triples, text None unless return_text_in_logprobs.

Pure formatting of what the scheduler computed: token texts are looked up in the
vocabulary's texts (each id decoded alone, by the tokenizer's process); it never
computes, reorders or drops a logprob."""

from __future__ import annotations

from typing import Any

from sgl.core.protocol import Logprobs
from sgl.runtime.req_options import ReqOptions


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
