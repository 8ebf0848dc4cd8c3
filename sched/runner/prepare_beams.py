"""The host's part of beam selection and of the constraints (tries, grammars) for
one batch, at build time: which sampled rows are a beam request's sources and which request rows carry
its beams next, grouped by shape for one batched top-k each (sgl.sched.runner.
beam_select); and, per trie, the rows it masks, the widest node they can be at
(from their depths, so the device gathers a fixed width), the nodes of rows whose
first token this batch samples, and the rows the sampled token advances; and the
grammar rows, whose token bitmasks are filled from their matchers only once the
previous step's results are processed (sgl.sched.runner.model_runner: the forward is
queued first, mask and sampling after), so the matcher has taken every token before
this one; a beam row's is its beam's own.

It reads request state and writes the beam groups' order into the batch
(`beam_index`, for the results); it runs nothing on the device."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sgl.cache.host_copy import to_device
from sgl.core.trie import Trie
from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req, beam_offsets
from sgl.sched.runner.beam_select import BeamGroup

if TYPE_CHECKING:
    from sgl.sched.runner.model_runner import ModelRunner

FILL_THREADS = 8  # threads filling a batch's grammar bitmasks (it overlaps the batch's forward)
BATCH_FILL_MIN = 16  # grammar rows from which the threaded fill pays (8 rows: 0.48 ms threaded, 0.27 alone)


@dataclass(slots=True)
class TrieGroup:
    trie: Trie  # on the device
    entries: torch.Tensor  # [b] the masked rows among the batch's sampled logits rows
    width: int  # the most children any of their nodes can have
    init_rows: torch.Tensor | None  # request rows whose node is (re)set before masking
    init_nodes: torch.Tensor | None
    advance: torch.Tensor | None  # [a] sampled rows (not beams) whose token moves their node
    advance_rows: torch.Tensor | None  # their request rows


@dataclass(slots=True)
class GrammarRows:
    """A batch's grammar rows, known at build time; their bitmasks are filled later
    (`grammar_mask`), once the previous step's tokens are in the matchers."""

    entries: torch.Tensor | None  # [g] the grammar rows among the sampled logits rows, on the device; None: all
    batch_rows: list[int]  # the same rows on the host (the batch's entries, for StepResult.errors)
    reqs: list[Req]
    beams: list[int]  # each row's beam within its request (0 for a plain request)
    width: int  # the bitmask's token ids (the tokenizer's): logits columns past it are never allowed


@dataclass(slots=True)
class GrammarFill:
    """A batch's filled bitmasks (on the device) and the rows whose request must end:
    a token its own mask allowed that the matcher then refused (an internal error)."""

    mask: torch.Tensor
    errors: dict[int, str]


def grammar_rows(batch: ScheduleBatch, runner: ModelRunner) -> GrammarRows | None:
    """The batch's grammar rows, or None when no sampled row has a grammar."""
    entries: list[int] = []
    reqs: list[Req] = []
    beams: list[int] = []
    for i, (r, beam) in enumerate(zip(batch.reqs, beam_offsets(batch.reqs))):
        if r.grammar is not None and sampled(batch, i):
            entries.append(i)
            reqs.append(r)
            beams.append(beam)
    if not entries:
        return None
    every = len(entries) == len(batch.reqs)  # the logits rows themselves, no gather and scatter
    dev = None if every else to_device(torch.tensor(entries, dtype=torch.int64), runner.device)
    return GrammarRows(dev, entries, reqs, beams, runner.grammar_vocab)


class MaskBuffer:
    """The host side of grammar bitmasks, allocated once (pinned on CUDA) and grown as
    batches need. One buffer is enough: a batch's masks are filled only after the
    previous batch's results were collected, so its copy to the device is done."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf = torch.empty(0, 0, dtype=torch.int32)

    def rows(self, n: int, width: int) -> torch.Tensor:
        words = (width + 31) // 32
        if self.buf.shape[0] < n or self.buf.shape[1] != words:
            self.buf = torch.empty(max(n, 2 * self.buf.shape[0]), words, dtype=torch.int32,
                                   pin_memory=self.device.type == "cuda")
        return self.buf[:n]


def grammar_mask(g: GrammarRows, buffer: MaskBuffer) -> GrammarFill:
    """The rows' token bitmasks from their matchers, on the device. First each plain
    request's matcher takes the tokens sampled since its last mask (the results
    processing only appends them: it never waits on a matcher); a beam's matchers took
    theirs at selection (sgl.sched.beam). A row whose request ended since the batch was
    built, or whose grammar is complete, stays all-allowed: its token is dropped."""
    import xgrammar

    errors: dict[int, str] = {}
    one_j: list[int] = []  # the usual case, one new token each: one native call for all
    one_m: list[Any] = []
    one_t: list[int] = []
    for j, r in enumerate(g.reqs):
        if r.beam is not None or r.grammar_seen == len(r.output_ids):
            continue
        new = r.output_ids[r.grammar_seen:]
        r.grammar_seen = len(r.output_ids)
        if len(new) == 1:
            one_j.append(j)
            one_m.append(r.grammar)
            one_t.append(new[0])
            continue
        for tok in new:
            if not r.grammar.is_terminated() and not r.grammar.accept_token(tok):
                errors[g.batch_rows[j]] = _refused(tok)
                break
    if one_m:
        oks = xgrammar.BatchGrammarMatcher.batch_accept_token(one_m, one_t)
        for j, m, tok, ok in zip(one_j, one_m, one_t, oks):
            if not ok and not m.is_terminated():  # an ended matcher refuses anything: that token is dropped
                errors[g.batch_rows[j]] = _refused(tok)
    mask = buffer.rows(len(g.reqs), g.width)
    rows: list[int] = []
    live: list[Any] = []
    for j, (r, beam) in enumerate(zip(g.reqs, g.beams)):
        own = r.beam.matchers if r.beam is not None else None
        m = r.grammar if own is None else own[beam]
        if not r.finished and g.batch_rows[j] not in errors and not m.is_terminated():
            rows.append(j)
            live.append(m)
        else:
            mask[j] = -1
    if len(live) >= BATCH_FILL_MIN:
        _filler().batch_fill_next_token_bitmask(live, mask, indices=rows)
    else:  # a few rows: the threads' hand-off costs more than it saves
        for j, m in zip(rows, live):
            m.fill_next_token_bitmask(mask, j)
    return GrammarFill(to_device(mask, buffer.device), errors)


def _refused(tok: int) -> str:
    return f"internal error: the grammar rejected token {tok}, which its own mask allowed"


@functools.cache
def _filler() -> Any:
    """xgrammar's batch mask filler, over up to FILL_THREADS threads: one matcher's fill
    takes ~25 us of CPU for a 49k vocabulary, so a batch of 256 would take 6 ms alone."""
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads=fill_threads())


def fill_threads() -> int:
    return max(1, min(FILL_THREADS, os.cpu_count() or 1))


def stop_ids_of(r: Req, eos_ids: frozenset[int]) -> list[int]:
    """The ids that end a beam: a grammar's beam ends on EOS even with ignore_eos (its
    matcher takes EOS only once the grammar is complete, and nothing after it)."""
    p = r.sampling_params
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos and r.grammar is None else eos_ids))


def sampled(batch: ScheduleBatch, i: int) -> bool:
    """Whether entry i samples a token this batch (not a middle chunk, not prefill-only)."""
    return not batch.partial[i] and not batch.reqs[i].prefill_only


def beam_groups(batch: ScheduleBatch, runner: ModelRunner) -> list[BeamGroup]:
    """The batch's beam requests, grouped by (sources, width, K, trie)."""
    groups: dict[tuple, list[tuple[Req, list[int], list[int], int, list[int]]]] = {}
    reqs, i, v = batch.reqs, 0, runner.vocab_size
    while i < len(reqs):
        r = reqs[i]
        if r.beam is None or not sampled(batch, i):
            i += 1
            continue
        n = r.beam.width if batch.is_decode else 1
        stop = stop_ids_of(r, runner.eos_ids)
        k = min(max(2, 1 + len(stop)) * r.beam.width, n * v)
        key = (n, r.beam.width, k, not batch.is_decode, id(r.trie))
        groups.setdefault(key, []).append((r, list(range(i, i + n)), batch.rows[i : i + n], batch.kv_lens[i], stop))
        i += n
    out: list[BeamGroup] = []
    dev = runner.device
    for gi, ((_n, _w, k, fresh, _t), members) in enumerate(groups.items()):
        m = max(1, max(len(stop) for *_, stop in members))
        for j, (r, *_rest) in enumerate(members):
            batch.beam_index[r] = (gi, j)
        trie = members[0][0].trie
        out.append(BeamGroup(
            src=to_device(torch.tensor([e for _, src, *_ in members for e in src], dtype=torch.int64), dev),
            src_pool=to_device(torch.tensor([rows for _, _, rows, _, _ in members], dtype=torch.int64), dev),
            tgt_pool=to_device(torch.tensor([r.rows for r, *_ in members], dtype=torch.int64), dev),
            stop=to_device(torch.tensor([stop + [-1] * (m - len(stop)) for *_, stop in members],
                                        dtype=torch.int64), dev),
            k=k, fresh=fresh, table_len=max(length for _, _, _, length, _ in members),
            trie=None if trie is None else trie.on(dev)))
    return out


def trie_groups(batch: ScheduleBatch, runner: ModelRunner) -> list[TrieGroup]:
    """The batch's trie-constrained rows, grouped by trie."""
    by: dict[int, tuple[Trie, list[int], list[int], list[int], list[int], list[int], list[int]]] = {}
    for i, r in enumerate(batch.reqs):
        if r.trie is None or not sampled(batch, i):
            continue
        trie, entries, depths, init_rows, init_nodes, adv, adv_rows = by.setdefault(
            id(r.trie), (r.trie, [], [], [], [], [], []))
        entries.append(i)
        if batch.is_decode:
            depths.append(len(r.output_ids) + r.inflight)
        else:
            depths.append(len(r.output_ids))
            init_rows.append(batch.rows[i])
            init_nodes.append(0 if r.beam is not None else trie.walk(r.output_ids))
        if r.beam is None:
            adv.append(i)
            adv_rows.append(batch.rows[i])
    dev = runner.device

    def t(values: list[int]) -> torch.Tensor | None:
        return to_device(torch.tensor(values, dtype=torch.int64), dev) if values else None

    return [TrieGroup(trie.on(dev), t(entries), max(trie.children_at(d) for d in depths),  # type: ignore[arg-type]
                      t(init_rows), t(init_nodes), t(adv), t(adv_rows))
            for trie, entries, depths, init_rows, init_nodes, adv, adv_rows in by.values()]
