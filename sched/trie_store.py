"""The scheduler's tries: built once per distinct set of sequences (kept by content,
the most recent MAX_KEPT), and kept under a name for requests that send only the
name (the most recent MAX_NAMED names; a request naming a dropped one is told to send
the sequences again). A request's constraint is resolved here on arrival, with
whether it must run its steps serially.

It builds and keeps tries; it never touches logits or request rows."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from sgl.core.sampling_params import TrieConstraint
from sgl.core.trie import Trie, build_trie, digest_of
from sgl.sched.req import Req

if TYPE_CHECKING:
    from sgl.sched.runner.model_runner import ModelRunner

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


def constrain(req: Req, store: TrieStore, runner: ModelRunner) -> str | None:
    """Set a new request's trie and whether it runs serially; why it cannot run, or None."""
    proc = runner.processors.get(req.processor) if req.processor else None
    # The host must know each step's outcome before the next: processors reading output ids,
    # beams under a grammar (which beam forks which matcher is known only from the
    # selection), and beams on CPU, whose forward worker would move rows while the next
    # batch is prepared. Plain grammar requests keep the overlap: their masks are filled
    # after the previous results are in (sgl.sched.runner.step.Deferred).
    beam_serial = req.beam is not None and (req.sampling_params.grammar is not None or runner.device.type == "cpu")
    req.serial = (proc is not None and proc.needs_output_ids) or beam_serial
    c = req.sampling_params.constraint
    if c is None:
        return None
    try:
        req.trie = store.get(c, runner.vocab_size)
    except ValueError as e:
        return str(e)
    return None
