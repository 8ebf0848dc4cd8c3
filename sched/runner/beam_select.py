"""Beam selection on the device, inside the step that computed the logits: for each
beam request, the top candidates over all its rows' continuations (Hugging Face's
rule: K = max(2, 1 + stop ids) x width candidates by cumulative logprob, of which the
best `width` that do not stop run on), and the running beams' state moved to the
rows that carry them next: each row's request-table entries (slot indices only: the
KV is never copied), its next input token, its cumulative score, its trie node.

So the next step, built on the host before these results arrive (the overlap loop),
finds every row ready on the device: no host sync beyond the results' one copy.
Requests of the same shape (sources, width, K, trie) are selected in one batched
top-k. The host reads the picks to keep its own view (sgl.sched.beam); it decides
here nothing the host must agree with that it cannot recompute from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl.core.host_copy import to_host
from sgl.core.trie import Trie
from sgl.kernels.trie_mask import trie_advance

DEAD = -1.0e8  # a cumulative score below this went through a mask: not a real beam
STOP_PENALTY = 1.0e9  # HF's: a stopping candidate never runs on


@dataclass(slots=True)
class BeamGroup:
    """Beam requests of one shape in a batch, prepared on the host."""

    src: torch.Tensor  # [G * S] the sources' rows among the batch's sampled logits rows
    src_pool: torch.Tensor  # [G, S] their request rows
    tgt_pool: torch.Tensor  # [G, W] the rows that carry the running beams next
    stop: torch.Tensor  # [G, M] each request's stop ids (-1 padded; M >= 1)
    k: int
    fresh: bool  # the first selection (one source, the prompt's row): no scores yet
    table_len: int  # request-table columns to move (the longest row's written length)
    trie: Trie | None  # on the device


@dataclass(slots=True)
class BeamPicks:
    """One group's candidates, best first: score, source index, token; and which K
    indices run on (`run`, [G, W])."""

    scores: torch.Tensor  # [G, K] float32
    source: torch.Tensor  # [G, K] int64
    token: torch.Tensor  # [G, K] int64
    run: torch.Tensor  # [G, W] int64

    def to_host(self, non_blocking: bool) -> BeamPicks:
        return BeamPicks(*(to_host(t, non_blocking) for t in (self.scores, self.source, self.token, self.run)))


@dataclass(slots=True)
class BeamBuffers:
    """Per request row, on the device: the running beam's cumulative score and trie node."""

    score: torch.Tensor  # [rows] float32
    node: torch.Tensor  # [rows] int64


def select(logp: torch.Tensor, g: BeamGroup, table: torch.Tensor, next_token: torch.Tensor,
           buf: BeamBuffers) -> BeamPicks:
    """logp: [B, V] processed log-probabilities of the batch's sampled rows."""
    n, s = g.src_pool.shape
    w = g.tgt_pool.shape[1]
    v = logp.shape[1]
    cand = logp[g.src].view(n, s, v)
    if not g.fresh:
        cand = cand + buf.score[g.src_pool][:, :, None]
    # The top K over all rows' continuations, in two stages (each row's top K, then the
    # best K of those): the same candidates as one top-k over [S x V], far cheaper at width 200.
    kk = min(g.k, v)
    row_scores, row_tokens = cand.topk(kk, dim=2)
    scores, flat = row_scores.reshape(n, s * kk).topk(g.k, dim=1)
    source, token = flat // kk, row_tokens.reshape(n, s * kk).gather(1, flat)
    stops = (token[:, :, None] == g.stop[:, None, :]).any(-1) | (scores < DEAD)
    run_scores, run = (scores - STOP_PENALTY * stops.float()).topk(w, dim=1)
    parent = g.src_pool.gather(1, source.gather(1, run)).reshape(-1)
    tgt = g.tgt_pool.reshape(-1)
    run_token = token.gather(1, run).reshape(-1)
    if g.table_len:
        table[tgt, : g.table_len] = table[parent, : g.table_len]  # the right side is a copy: rows may swap
    next_token[tgt] = run_token
    buf.score[tgt] = run_scores.reshape(-1)
    if g.trie is not None:
        buf.node[tgt] = trie_advance(g.trie, buf.node[parent], run_token)
    return BeamPicks(scores, source, token, run)
