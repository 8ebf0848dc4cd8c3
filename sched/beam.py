"""Beam search on the host: a step's picks (sgl.sched.runner.beam_select) applied to
the request's own view, with Hugging Face's rules (transformers' `_beam_search`):

- of the K candidates, best first, those among the first `width` that stop (a stop
  id, or the length limit) become finished hypotheses scored cumulative logprob /
  generated_len ** length_penalty, while the search is still open and, with
  early_stopping=True, until `width` are finished; the best `width` are kept;
- the best `width` candidates that do not stop run on (the device chose them too);
- the search stays open while fewer than `width` are finished or the best running
  beam could still beat the worst finished one (HF's heuristic: at the current
  length, or at max_new_tokens with early_stopping="never" and a positive penalty);
  it ends when closed, when early_stopping=True and `width` are finished, or when
  every candidate stops.
A candidate whose score went through a mask (below DEAD: a trie with fewer
continuations than beams) is never finished: a beam request may return fewer beams.

The rows are moved on the host as on the device (sgl.sched.kv_cache.KVCache
.move_beam_rows), and the slots no beam continues from are freed. Nothing here runs on
the device or builds batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sgl.core.protocol import Beam
from sgl.sched.batch import ScheduleBatch
from sgl.sched.kv_cache import KVCache
from sgl.sched.req import Req
from sgl.sched.runner.beam_select import DEAD, STOP_PENALTY, BeamPicks
from sgl.sched.runner.prepare_beams import stop_ids_of


class BeamSearch:
    """Applies beam requests' selections; `finish` ends a request (the scheduler's)."""

    def __init__(self, kv: KVCache, eos_ids: frozenset[int], context_length: int,
                 finish: Callable[[Req, dict[str, Any]], None]) -> None:
        self.kv = kv
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.finish = finish

    def apply(self, batch: ScheduleBatch, i: int, req: Req, picks: BeamPicks, n: int) -> None:
        """The step's selection for the beam request whose entries start at batch entry i."""
        b = req.beam
        assert b is not None
        p = req.sampling_params
        w = b.width
        scores, source = picks.scores[n].tolist(), picks.source[n].tolist()
        token, run = picks.token[n].tolist(), picks.run[n].tolist()
        t = len(b.outputs[0])  # tokens before this step
        stops = set(stop_ids_of(req, self.eos_ids))
        by_length = t + 1 >= p.max_new_tokens or len(req.origin_input_ids) + t + 1 >= self.context_length
        hits = [by_length or tok in stops for tok in token]
        parents = [source[k] for k in run]
        if not batch.is_decode:
            self.kv.fan_out_prompt(req)
        else:  # this step's written length; a later step's slot may already follow
            written = batch.out_cache_loc[i : i + w].to("cpu", torch.int64)
            self.kv.move_beam_rows(req, parents, batch.kv_lens[i], written)
        if req.grammar is not None:
            _fork_matchers(req, parents, [token[k] for k in run])
        lp = p.length_penalty
        if b.open and not (len(b.finished) >= w and p.early_stopping is True):
            new = [(scores[k] / (t + 1) ** lp, scores[k], b.outputs[source[k]] + [token[k]],
                    {"type": "stop", "matched": token[k]} if token[k] in stops else {"type": "length", "length": t + 1})
                   for k in range(w) if hits[k] and scores[k] > DEAD]
            if new:
                b.finished = sorted(b.finished + new, key=lambda f: -f[0])[:w]  # stable: earlier ones first on ties
        b.outputs = [b.outputs[source[k]] + [token[k]] for k in run]
        b.scores = [scores[k] - (STOP_PENALTY if token[k] in stops or scores[k] < DEAD else 0.0) for k in run]
        req.output_ids = list(b.outputs[0])
        best_len = p.max_new_tokens if p.early_stopping == "never" and lp > 0 else t + 1
        worst = min(f[0] for f in b.finished) if len(b.finished) >= w else -STOP_PENALTY
        b.open = b.open and b.scores[0] / best_len ** lp > worst
        if not b.open or (len(b.finished) >= w and p.early_stopping is True) or all(hits) or b.scores[0] < DEAD:
            self._finish(req)

    def _finish(self, req: Req) -> None:
        """End a beam request with its finished beams, best first."""
        b = req.beam
        assert b is not None
        keep = b.finished[: req.sampling_params.return_beams]
        if keep:
            req.output_ids = list(keep[0][2])
        req.sent_len = len(req.output_ids)  # the beams carry the ids
        b.result = [Beam(ids, cum, score, reason) for score, cum, ids, reason in keep]
        self.finish(req, keep[0][3] if keep else {"type": "length", "length": len(req.output_ids)})


def _fork_matchers(req: Req, parents: list[int], tokens: list[int]) -> None:
    """Each running beam's matcher: its parent's, forked, having taken its token. A
    token the mask did not allow (a dead beam's, scored below DEAD) leaves the fork
    as it was: that beam never finishes or leads."""
    b = req.beam
    assert b is not None
    before = b.matchers or [req.grammar]
    out = []
    for parent, tok in zip(parents, tokens):
        m = before[parent].fork()
        if not m.is_terminated():
            m.accept_token(tok)
        out.append(m)
    b.matchers = out
