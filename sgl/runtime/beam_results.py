"""A beam-search request's result: the list of its beams as result dicts, best first.

Each is `{"text", "output_ids", "meta_info"}` like any result, its meta_info the
request's (id, prompt_tokens, cached_tokens, e2e_latency) with the beam's own
finish_reason and completion_tokens, plus cumulative_logprob, score and
beam_index (0: the best). Pure: it builds dicts from a message's beams."""

from __future__ import annotations

from typing import Any

from sgl.core.protocol import Beam

STREAM_ERROR = "stream=True is invalid with beam_width: the beams come back together once they finish"


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
