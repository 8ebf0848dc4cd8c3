"""Trie constraints on the device: mask each row's logits to its trie node's children
(and EOS where a sequence ends), and advance each row's node by its chosen token.

Both are a fixed number of tensor ops over the batch, with no host sync and no
per-row Python: `width` (the most children any row's node can have, known on the
host from the rows' depths) bounds the gather. A node of -1 (a row that left the
trie, which only an EOS can do) allows EOS alone. It decides nothing about which
token is taken: the sampler and the beam selection do."""

from __future__ import annotations

import torch

from sgl.core.trie import Trie


def trie_mask_(logits: torch.Tensor, trie: Trie, nodes: torch.Tensor, width: int, eos_ids: torch.Tensor) -> None:
    """In place: logits[i] keeps the children of nodes[i] (and eos_ids where that node
    is terminal); every other entry becomes -inf."""
    b, v = logits.shape
    live = nodes >= 0
    at = nodes.clamp(min=0)
    allow = torch.zeros(b, v + 1, dtype=torch.bool, device=logits.device)
    edges = int(trie.tokens.shape[0])
    if width > 0 and edges:
        start = trie.indptr[at]
        idx = start[:, None] + torch.arange(width, device=logits.device)
        valid = (idx < trie.indptr[at + 1][:, None]) & live[:, None]
        tok = torch.where(valid, trie.tokens[idx.clamp(max=edges - 1)], v)  # column v: the discarded one
        allow.scatter_(1, tok, True)
    allow = allow[:, :v]
    if eos_ids.numel():
        ends = (trie.terminal[at] | ~live)[:, None]
        allow[:, eos_ids] |= ends
    logits.masked_fill_(~allow, float("-inf"))


def trie_advance(trie: Trie, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The node each row reaches by its token; -1 where that leaves the trie (an EOS)."""
    edges = int(trie.keys.shape[0])
    if edges == 0:
        return torch.full_like(nodes, -1)
    q = nodes.clamp(min=0) * trie.vocab_size + tokens
    i = torch.searchsorted(trie.keys, q).clamp(max=edges - 1)
    hit = (trie.keys[i] == q) & (nodes >= 0)
    return torch.where(hit, trie.child[i], torch.full_like(nodes, -1))
