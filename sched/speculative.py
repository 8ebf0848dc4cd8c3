"""Speculative decoding: proposals by n-gram lookup (prompt lookup: from a request's
own prompt and output) or from a draft model, and what a verify step's sampled tokens
make of them.

A speculative decode step runs, for each request, its last token and the d tokens
proposed after it as d + 1 consecutive decode rows of its one request row (each row
attends to the ones before it: their KV is written in the same forward before attention
reads it), and samples every row as plain decode would sample it, with the request's
parameters and a seed's draw for that output position. The request takes the sampled
tokens up to and including the first that differs from the proposal after it. For a
proposal that is a single token (a point mass), "sample the row and accept the proposal
iff the sample equals it" is exactly speculative sampling's rule: the proposal is taken
with probability p(proposal), and on a rejection the sample is drawn from p without it,
renormalised, which is the residual distribution. So greedy and sampled outputs are
those of plain decode, token for token under a seed.

A draft model (STANDALONE) proposes its most likely token k times: a point mass each,
so the rule above is speculative sampling's for it too, for any sampling parameters.
Its KV lives in a pool of its own at the request's slots (sgl.sched.runner.draft), so
the request table and the allocator serve both models; `Req.draft_len` says how far it
is written. Before proposing, the draft catches up on the tokens it has not seen (a new
request's prompt, a step's bonus token, what plain steps added), within a budget of
tokens per step: a request past the budget catches up over several steps and proposes
once it has. A cached prefix's draft KV is computed again by each request (the radix
cache shares the target's KV only).

N-gram proposals: the longest suffix of the request's tokens (max down to min window) that
occurred earlier in them; the tokens that followed its latest earlier occurrence are
the proposal. The search runs in C over the tokens packed as 4-byte words
(bytes.rfind), kept per request and appended to as tokens come: a kept library for
this exists only as part of other engines (vLLM's numba proposer, SGLang's C++ trie).

Speculating costs the overlap loop's hiding of the host's work: a request with proposals
steps again only once its step's results are in. So a request proposes only when it is
likely to gain: while in flight it takes plain rows (overlapped, input on the device)
unless it has something to propose (NGRAM: a match among its tokens so far; a draft
always has), in which case it sits out one step and proposes with its tokens up to date;
and after a verify that kept none of its proposals it takes plain steps for a while
(BACKOFF_STEPS, doubling with each such verify in a row, up to MAX_BACKOFF_STEPS) before
it proposes again. Outputs are the same either way: only the proposals change.

Requests that sit out while others step fall into groups that verify in turns, each every
other step: the host's work for one group hides behind the other's forward, but each
request gains its tokens half as often. When the device is the slower side that is the
worse bargain: a step of every request costs the host's work for all plus one forward
(decode at small batches barely grows with rows), two steps of half cost two forwards.
The loop's pace tells which side is slower: the host's time per turn (building and
processing) against its wait for results, each a running mean (`pace`). While the wait
is longer (`regroups`), a step is not launched while a request with something to propose
sits out: the loop waits for the step in flight, and the groups verify together from then
on. The two measures compare the same thing in either rhythm: in turns, a turn waits the
forward less the host's work; together, every other turn waits a whole forward for the
host's work of all. Under tensor parallelism rank 0's pace decides for every rank: each
rank reads its own clock, and their batches must be the same.

Nothing here allocates KV, builds batches or runs the model."""

from __future__ import annotations

import array
from typing import Any

from sgl.core.server_args import ServerArgs
from sgl.sched.models.parallel import TPGroup
from sgl.sched.req import Req

_WORD = 4  # bytes per token id in a request's packed ids
# Plain steps a request takes after a verify that kept none of its proposals, doubling with
# each such verify in a row, at most MAX_BACKOFF_STEPS.
BACKOFF_STEPS = 2
MAX_BACKOFF_STEPS = 32
PACE_WEIGHT = 0.1  # a turn's weight in the running means of the loop's host time and wait


class NgramIndex:
    """One request's tokens packed as int32 words for the suffix search."""

    __slots__ = ("ids", "buf", "before_last")

    def __init__(self) -> None:
        self.ids = array.array("i")
        self.buf = b""
        self.before_last: set[int] = set()  # the ids that occur before the last token

    def sync(self, req: Req) -> None:
        """Take in the request's tokens not seen yet (prompt, then outputs as they come)."""
        n = old = len(self.ids)
        prompt = req.origin_input_ids
        if n < len(prompt):
            self.ids.extend(prompt[n:])
            n = len(prompt)
        out = req.output_ids
        if n < len(prompt) + len(out):
            self.ids.extend(out[n - len(prompt):])
        if len(self.buf) != len(self.ids) * _WORD:
            self.buf = self.ids.tobytes()
            self.before_last.update(self.ids[max(old - 1, 0):-1])  # the old last one, and the new but the last

    def propose(self, k: int, lo: int, hi: int) -> list[int]:
        """Up to k tokens: what followed the latest earlier occurrence of the longest
        suffix of lo..hi tokens; [] when none occurred."""
        # The shortest window first (a longer suffix that occurred earlier ends with it, so
        # without it there is nothing to look for), kept when no longer one matches.
        if (shortest := self._shortest(lo)) == -1:
            return []
        for n in range(min(hi, len(self.ids) - 1), lo, -1):
            if (start := self._after_latest(n)) >= 0:
                return self.ids[start:start + k].tolist()
        start = self._after_latest(lo) if shortest is None else shortest
        return self.ids[start:start + k].tolist()

    def has_match(self, lo: int) -> bool:
        """Whether `propose` with windows from lo up has something to give (any longer
        suffix that occurred earlier ends with the lo-token one): for one token, whether
        the last occurred before (a set lookup); else one search."""
        return self._shortest(lo) != -1

    def _shortest(self, lo: int) -> int | None:
        """`_after_latest(lo)`, except that for one token a set lookup answers whether it
        occurred (None: it did, where not looked up)."""
        if lo > len(self.ids) - 1:
            return -1
        if lo == 1:
            return None if self.ids[-1] in self.before_last else -1
        return self._after_latest(lo)

    def _after_latest(self, n: int) -> int:
        """The index of the token after the latest earlier occurrence of the last n tokens, or -1."""
        buf = self.buf
        pattern = buf[(len(self.ids) - n) * _WORD:]
        end = (len(self.ids) - 1) * _WORD  # a match must end before the last token: something follows it
        at = buf.rfind(pattern, 0, end)
        while at >= 0 and at % _WORD:  # a match across word boundaries is not one of tokens
            at = buf.rfind(pattern, 0, at + len(pattern) - 1)
        return at // _WORD + n if at >= 0 else -1


class SpecState:
    """One request's speculation: its packed tokens (NGRAM's; None under a draft model) and its back-off."""

    __slots__ = ("index", "wait", "misses")

    def __init__(self, index: NgramIndex | None) -> None:
        self.index = index
        self.wait = 0  # plain steps to take before it proposes again
        self.misses = 0  # verifies in a row that kept none of its proposals

    def verified(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        self.wait = min(BACKOFF_STEPS << (self.misses - 1), MAX_BACKOFF_STEPS)


# A draft model's work for one request in a step: (first position, its tokens from there).
CatchUp = tuple[int, list[int]]


class Speculator:
    """The proposer of an engine (NGRAM, or STANDALONE's plan for the draft model) and its
    acceptance counts. A request speculates unless its next token depends on state the
    verify rows do not carry: beams, a trie, penalties (counts per request row), a custom
    logit processor (it may read the output ids), or a grammar that starts after the
    request's reasoning, which has not ended yet. A grammar request's proposal rows are
    masked by its matcher as it would stand after each proposal
    (sgl.sched.runner.grammar_masks)."""

    def __init__(self, args: ServerArgs, catch_up_tokens: int, tp: TPGroup = TPGroup()) -> None:
        self.tp = tp
        self.algorithm = args.speculative_algorithm
        self.drafted = self.algorithm == "STANDALONE"
        self.catch_up_tokens = catch_up_tokens  # tokens a step's draft catches up on, at most
        self.rows = args.speculative_num_draft_tokens  # rows a request verifies per step, at most
        self.lo = args.speculative_ngram_min_match_window_size
        self.hi = args.speculative_ngram_max_match_window_size
        self.max_batch = args.speculative_disable_by_batch_size
        # spec_steps: requests' steps with proposals; spec_plain_steps: without (in flight, backing
        # off, nothing to propose), in speculative batches; spec_regroups: steps held back so that
        # the requests verify together (`regroups`).
        self.stats = {"spec_steps": 0, "spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_plain_steps": 0,
                      "spec_regroups": 0}
        # Running means of a turn's host time (building, processing) and its wait for results.
        self.host_s = 0.0
        self.wait_s = 0.0

    def pace(self, host_s: float, wait_s: float) -> None:
        """One turn of the loop with a step launched or waited for."""
        self.host_s += PACE_WEIGHT * (host_s - self.host_s)
        self.wait_s += PACE_WEIGHT * (wait_s - self.wait_s)

    def regroups(self) -> bool:
        """Whether the device is the slower side, so requests that sit out for their results
        are waited for rather than stepped around: rank 0's answer on every rank (each rank
        asks in the same turn, its state being the same)."""
        mine = self.wait_s > self.host_s
        if self.tp.size == 1:
            return mine
        return self.tp.min_int(int(mine) if self.tp.rank == 0 else 1) == 1

    def on_for(self, running: int) -> bool:
        """Whether a decode step of `running` requests speculates."""
        return self.max_batch is None or running <= self.max_batch

    @staticmethod
    def eligible(req: Req) -> bool:
        p = req.sampling_params
        return (req.beam is None and req.trie is None and not p.has_penalties and not req.processor
                and req.grammar_after is None)

    def state(self, req: Req) -> SpecState:
        st = req.spec
        if st is None:
            st = req.spec = SpecState(None if self.drafted else NgramIndex())
        return st

    def ngrams(self, req: Req) -> NgramIndex:
        """NGRAM's packed tokens of `req`, up to date."""
        index = self.state(req).index
        assert index is not None, "a draft model's requests keep no n-gram index"
        index.sync(req)
        return index

    def waits_for_results(self, req: Req, context_length: int) -> bool:
        """Whether a request in flight sits out the next step so that it proposes in the
        one after, with its tokens on the host up to date; otherwise it takes a plain row."""
        if not self.eligible(req) or req.tokens_left(context_length) - req.inflight <= 1:
            return False
        if self.state(req).wait:
            return False
        return self.drafted or self.ngrams(req).has_match(self.lo)

    def propose(self, reqs: list[Req], context_length: int,
                max_rows: int | None) -> tuple[list[list[int]], list[CatchUp | None] | None]:
        """Each request's proposal for the next step ([] for none): at most rows - 1
        tokens, fewer when its output or context has less room (its last token and the
        proposal fill rows of the request table, and every one could be accepted), and
        all together within max_rows decode rows (the CUDA graphs' largest batch). A draft
        model's proposals are placeholders (-1) it fills, and its work per request comes
        second (None for NGRAM)."""
        k = self.rows - 1
        if max_rows is not None:
            k = min(k, max(0, (max_rows - len(reqs)) // len(reqs)))
        props: list[list[int]] = []
        work: list[CatchUp | None] = []
        budget = self.catch_up_tokens
        for r in reqs:
            room = min(k, r.tokens_left(context_length) - 1)
            st = self.state(r)
            if room <= 0 or not self.eligible(r) or st.wait or r.inflight:  # a plain row
                st.wait = max(0, st.wait - 1)
                props.append([])
                work.append(None)
            elif self.drafted:
                start = r.draft_len
                need = r.kv_len + 1 - start  # through its last token, whose KV this step writes
                took = min(need, budget)
                budget -= took
                props.append([-1] * room if took == need else [])
                work.append((start, r.ids_between(start, start + took)) if took else None)
            else:
                props.append(self.ngrams(r).propose(room, self.lo, self.hi))
                work.append(None)
        return props, work if self.drafted else None

    @staticmethod
    def accepted(proposal: list[int], sampled: list[int]) -> int:
        """How many proposed tokens the verify rows' sampled tokens accept: row j's sample
        must equal proposal j (row j's input is the token before it)."""
        a = 0
        while a < len(proposal) and sampled[a] == proposal[a]:
            a += 1
        return a

    def record(self, req: Req, proposed: int, taken: int) -> None:
        """One request's step in a speculative batch: `proposed` tokens, `taken` tokens it
        kept (proposals and the last sampled one)."""
        st = self.stats
        self.state(req).verified(proposed, taken - 1)
        if not proposed:
            st["spec_plain_steps"] += 1
            return
        st["spec_steps"] += 1
        st["spec_proposed_tokens"] += proposed
        st["spec_accepted_tokens"] += taken - 1

    def info(self) -> dict[str, Any]:
        st = self.stats
        steps = st["spec_steps"]
        # SGLang's accept length: tokens a request gains per verify step (its accepted proposals and one more).
        return {**st, "spec_algorithm": self.algorithm, "spec_num_draft_tokens": self.rows,
                "spec_accept_length": (steps + st["spec_accepted_tokens"]) / steps if steps else None}
