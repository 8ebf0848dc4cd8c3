"""The host's part of beam selection and of the constraints (tries, grammars) for
one batch, at build time: which sampled rows are a beam request's sources and which request rows carry
its beams next, grouped by shape for one batched top-k each (sgl.sched.runner.
beam_select); and, per trie, the rows it masks, the widest node they can be at
(from their depths, so the device gathers a fixed width), the nodes of rows whose
first token this batch samples, and the rows the sampled token advances. Grammar
rows are sgl.sched.runner.grammar_masks'.

It reads request state and writes the beam groups' order into the batch
(`beam_index`, for the results); it runs nothing on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl.core.host_copy import to_device
from sgl.core.trie import Trie
from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req
from sgl.sched.runner.beam_select import BeamGroup

if TYPE_CHECKING:
    from sgl.sched.runner.model_runner import ModelRunner


@dataclass(slots=True)
class TrieGroup:
    trie: Trie  # on the device
    entries: torch.Tensor  # [b] the masked rows among the batch's sampled logits rows
    width: int  # the most children any of their nodes can have
    init_rows: torch.Tensor | None  # request rows whose node is (re)set before masking
    init_nodes: torch.Tensor | None
    advance: torch.Tensor | None  # [a] sampled rows (not beams) whose token moves their node
    advance_rows: torch.Tensor | None  # their request rows


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
