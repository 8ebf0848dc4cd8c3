"""The scheduler's tries: built once per distinct set of sequences (kept by content,
the most recent MAX_KEPT), and kept under a name for requests that send only the
name (the most recent MAX_NAMED names; a request naming a dropped one is told to send
the sequences again).

It builds and keeps tries; it never touches logits or request rows."""

from __future__ import annotations

from collections import OrderedDict

from sgl.core.sampling_params import TrieConstraint
from sgl.core.trie import Trie, build_trie, digest_of

MAX_KEPT = 16
MAX_NAMED = 64


class TrieStore:
    def __init__(self) -> None:
        self.by_digest: OrderedDict[str, Trie] = OrderedDict()
        self.by_name: OrderedDict[str, Trie] = OrderedDict()

    def get(self, c: TrieConstraint, vocab_size: int) -> Trie:
        """The trie a constraint asks for; ValueError naming the field if it cannot be had."""
        if c.sequences is None:
            assert c.name is not None  # TrieConstraint checks one of them is set
            trie = self.by_name.get(c.name)
            if trie is None:
                raise ValueError(f"constraint.name: no trie is kept under {c.name!r} (send its sequences "
                                 f"with the name once; at most {MAX_NAMED} names are kept)")
            self.by_name.move_to_end(c.name)
            return trie
        digest = digest_of(c.sequences)
        trie = self.by_digest.get(digest)
        if trie is None:
            trie = build_trie(c.sequences, vocab_size, digest)
            self.by_digest[digest] = trie
            if len(self.by_digest) > MAX_KEPT:
                self.by_digest.popitem(last=False)
        self.by_digest.move_to_end(digest)
        if c.name is not None:
            self.by_name[c.name] = trie
            self.by_name.move_to_end(c.name)
            if len(self.by_name) > MAX_NAMED:
                self.by_name.popitem(last=False)
        return trie
