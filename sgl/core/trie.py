"""A token-id trie of allowed sequences, built once on the host into flat tables that a
device can index without per-row Python (the sparse transition table of the seed's
STATIC pattern): node n's children are edges [indptr[n], indptr[n + 1]), sorted by
token, so `keys = parent * vocab + token` is sorted over all edges and the child of
(node, token) is one searchsorted away.

Node 0 is the root. `terminal[n]`: a sequence ends at n (EOS is allowed there). A node
with no children and no terminal flag does not exist: every leaf ends a sequence.

It builds and describes tries; it never touches logits (sgl.kernels.trie_mask does)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Trie:
    vocab_size: int
    indptr: torch.Tensor  # [N + 1] int64: node n's edges
    tokens: torch.Tensor  # [E] int64: edge token, sorted within a node
    child: torch.Tensor  # [E] int64: edge target node
    keys: torch.Tensor  # [E] int64: parent * vocab_size + token, sorted
    terminal: torch.Tensor  # [N] bool
    max_children: list[int]  # per depth, the most children any node at that depth has
    digest: str
    _device: dict[str, Trie] = field(default_factory=dict)  # copies of the tables per device

    def children_at(self, depth: int) -> int:
        """How many children a node at `depth` may have (0 past the longest sequence)."""
        return self.max_children[depth] if 0 <= depth < len(self.max_children) else 0

    def walk(self, ids: Sequence[int]) -> int:
        """The node `ids` lead to from the root, or -1 when they leave the trie (host, O(len))."""
        node = 0
        for t in ids:
            lo, hi = int(self.indptr[node]), int(self.indptr[node + 1])
            i = int(torch.searchsorted(self.tokens[lo:hi], t)) + lo
            if i >= hi or int(self.tokens[i]) != t:
                return -1
            node = int(self.child[i])
        return node

    def on(self, device: torch.device) -> Trie:
        """The tables on `device` (copied once, then kept)."""
        if device.type == "cpu":
            return self
        key = str(device)
        if key not in self._device:
            self._device[key] = Trie(self.vocab_size, self.indptr.to(device), self.tokens.to(device),
                                     self.child.to(device), self.keys.to(device), self.terminal.to(device),
                                     self.max_children, self.digest)
        return self._device[key]


def digest_of(sequences: Sequence[Sequence[int]]) -> str:
    """A content key for a list of sequences: the same list gives the same key (a
    reordered list gets another key and builds the same trie again)."""
    h = hashlib.blake2b(digest_size=16)
    for q in sequences:
        h.update(len(q).to_bytes(4, "little"))
        h.update(b"".join(int(t).to_bytes(8, "little") for t in q))
    return h.hexdigest()


def build_trie(sequences: Sequence[Sequence[int]], vocab_size: int, digest: str | None = None) -> Trie:
    """The trie of `sequences` (ids in [0, vocab_size), each non-empty). Nodes are numbered
    breadth first, so a depth's nodes are contiguous."""
    if not sequences:
        raise ValueError("constraint.sequences: a trie needs at least one sequence")
    root: dict[int, dict] = {}
    ends: set[int] = set()
    for q in sequences:
        if not q:
            raise ValueError("constraint.sequences: empty sequence")
        node = root
        for t in q:
            if not 0 <= t < vocab_size:
                raise ValueError(f"constraint.sequences: ids must lie in [0, {vocab_size})")
            node = node.setdefault(t, {})
        ends.add(id(node))
    indptr = [0]
    tokens: list[int] = []
    child: list[int] = []
    terminal: list[bool] = []
    max_children: list[int] = []
    level = [root]
    next_id = 1
    while level:
        nxt: list[dict] = []
        widest = 0
        for node in level:
            terminal.append(id(node) in ends)
            items = sorted(node.items())
            widest = max(widest, len(items))
            for t, sub in items:
                tokens.append(t)
                child.append(next_id)
                next_id += 1
                nxt.append(sub)
            indptr.append(len(tokens))
        max_children.append(widest)
        level = nxt
    ind = torch.tensor(indptr, dtype=torch.int64)
    tok = torch.tensor(tokens, dtype=torch.int64)
    parent = torch.repeat_interleave(torch.arange(len(terminal), dtype=torch.int64), ind.diff())
    return Trie(vocab_size, ind, tok, torch.tensor(child, dtype=torch.int64), parent * vocab_size + tok,
                torch.tensor(terminal, dtype=torch.bool), max_children, digest or digest_of(sequences))
