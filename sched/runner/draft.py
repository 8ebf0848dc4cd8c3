"""The draft model of STANDALONE speculative decoding: a smaller model of the target's
tokenizer, with a KV pool of its own at the target's slot ids (the request table and
the allocator serve both models), which fills a speculative step's proposal entries
when the step is prepared (sgl.sched.speculative says what it proposes, and why the
outputs stay those of plain decoding).

Per step: one forward over each request's tokens the draft has not seen (through its
last token), then one decode forward per further proposal, each feeding back the
token it proposed last. The first runs as decode rows, one a token, while every
request's unseen tokens are few (a verify's rows at most: its bonus token and the
proposals it did not feed back), each row attending to those before it as a verify's
rows do; as one prefill otherwise (a new request's prompt). The others' positions, KV
slots and attention metadata are known before the first runs: they go to the device in
one copy, their KV slots gathered in one launch. Every proposal is the
draft's most likely token, kept on the device as the next forward's input and the
verify rows' input (the host gets its copy with the step's results; a grammar's matcher
takes each on the host, so a step with grammar requests waits for each pick). The
forwards run on the scheduler's side of the loop, before the step's own forward is
queued. On a GPU they replay CUDA graphs of the draft's own, as the target's do: its
decode forwards (decode-row catch-ups too) through decode graphs, a prefill catch-up
through the piecewise prefill graphs; a draft forward's host work would otherwise
outlast its kernels several times over.

It decides nothing: which requests propose, how many tokens and from which position
the draft catches up come with the batch (ScheduleBatch.drafts). It never allocates
slots and never changes a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sgl.cache.kv_pool import MHATokenToKVPool
from sgl.cache.req_to_token_pool import ReqToTokenPool
from sgl.core.host_copy import Uploads, to_device, to_host
from sgl.kernels.attention import AttentionBackend, AttnMetadata
from sgl.sched.batch import DraftInput, ScheduleBatch
from sgl.sched.models.forward_batch import CausalLM, ForwardBatch
from sgl.sched.models.lora_layers import LoraSpec
from sgl.sched.req import Req
from sgl.sched.runner.grammar_masks import apply_masks
from sgl.sched.runner.prefill_graph import PrefillGraphs, supports_pieces
from sgl.sched.runner.prepare import indptr_of
from sgl.sched.runner.weights import WeightManager

if TYPE_CHECKING:
    from sgl.sched.runner.cuda_graph import CudaGraphRunner
    from sgl.sched.runner.prepare import BatchPreparer


@dataclass(frozen=True, slots=True)
class GuessStep:
    """One guess forward of a draft step, its inputs on the device before the first runs."""

    works: list[int]  # the works (indices into the step's) that want the proposal it makes
    keep: torch.Tensor | None  # their places among the previous forward's works (None: all of those)
    positions: torch.Tensor  # where each feeds its last proposal back
    slots: torch.Tensor  # that position's KV slot
    attn: AttnMetadata


class DraftModel:
    """The draft, a ModelOnDevice (sgl.sched.models.forward_batch): its weights, KV pool,
    attention backend and graphs."""

    cascade: bool = False  # a draft's decode batches are small: no cascade attention
    lora_spec: LoraSpec | None = None  # adapters serve the target alone

    def __init__(self, model: CausalLM, weights: WeightManager, kv_pool: MHATokenToKVPool,
                 backend: AttentionBackend, table: ReqToTokenPool, preparer: BatchPreparer, vocab_size: int,
                 dtype: torch.dtype, catch_up_rows: int) -> None:
        self.model = model
        self.weights = weights  # its memory, released and resumed with the target's
        self.kv_pool = kv_pool
        self.attn_backend = backend
        self.device = kv_pool.device
        self.dtype = dtype
        self.table = table  # the target's request table
        self.preparer = preparer  # the target's: attention metadata from the table's mirror
        self.vocab_size = vocab_size  # ids it may propose: the target's vocabulary (a draft's may be padded wider)
        # A catch-up of at most this many tokens a request runs as decode rows: on a GPU one
        # decode graph's replay, where a prefill runs its attention eagerly between graph
        # pieces (a launch a layer, several times the forward's kernels at these sizes).
        self.catch_up_rows = catch_up_rows
        self.graphs: CudaGraphRunner | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.graph_forwards = 0  # forwards that replayed graphs (decode or pieces), for server info

    def capture(self, max_bs: int, max_tokens: int | None) -> None:
        """Capture the draft's decode graphs up to `max_bs` requests and, where its model
        runs in pieces, its prefill pieces up to `max_tokens` tokens."""
        from sgl.sched.runner.cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self, max_bs)
        if max_tokens is not None and supports_pieces(self.model):
            self.prefill_graphs = PrefillGraphs(self, max_tokens)

    def drop_graphs(self) -> None:
        self.graphs = self.prefill_graphs = None

    @torch.inference_mode()
    def propose(self, batch: ScheduleBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each drafting request's proposals, catching up on its unseen tokens first: as
        (entries, tokens) on the device for the step's inputs, the host's copy queued into
        the batch (ScheduleBatch.proposed); or, where a drafting request has a grammar (its
        matcher takes each pick on the host), written into the batch's input_ids, and None."""
        works = batch.drafts
        assert works is not None and batch.input_ids is not None
        self.table.sync()
        rows = [batch.rows[w.entry] for w in works]
        ends = [w.start + len(w.tokens) for w in works]  # positions the draft's KV reaches after catching up
        logits = self._catch_up(rows, works, ends)
        drafting = [i for i, w in enumerate(works) if w.k]
        guide = DraftGrammars([batch.reqs[works[i].entry] for i in drafting], drafting)
        last = guide.pick(logits, list(range(len(works))))  # each work's first proposal, on the device
        if not drafting:
            guide.rollback()
            return None
        first, steps = self._guess_steps(rows, works, ends, drafting)
        picks = [last if first is None else last[first]]  # proposal 1 of each drafting work
        entries = [works[i].entry + 1 for i in drafting]
        for j, step in enumerate(steps, start=2):
            ids = picks[-1] if step.keep is None else picks[-1][step.keep]
            picks.append(guide.pick(self._guess(step, ids), step.works))  # proposal j
            entries += [works[i].entry + j for i in step.works]
        guide.rollback()
        tokens = torch.cat(picks)
        if guide.guided:
            for e, t in zip(entries, tokens.tolist()):
                batch.input_ids[e] = t
            return None
        batch.proposed = (entries, to_host(tokens))
        return to_device(torch.tensor(entries, dtype=torch.int64), self.device), tokens

    def _guess_steps(self, rows: list[int], works: list[DraftInput], ends: list[int],
                     drafting: list[int]) -> tuple[torch.Tensor | None, list[GuessStep]]:
        """The guess forwards after the catch-up, planned and uploaded together: the one
        that makes proposal p + 1 feeds proposal p back, at position ends[i] - 1 + p, for
        the works that want one more. Also the drafting works' places among all works
        (None: all of them draft)."""
        sets: list[tuple[list[int], list[int], int]] = []  # (works, the previous forward's, proposal fed back)
        cur, j = drafting, 1
        while nxt := [i for i in cur if works[i].k > j]:
            sets.append((nxt, cur, j))
            cur, j = nxt, j + 1
        up = Uploads(self.device)
        at_first = None if len(drafting) == len(works) else up.add(torch.tensor(drafting, dtype=torch.int64))
        pos = torch.tensor([ends[i] - 1 + j for ws, _, j in sets for i in ws], dtype=torch.int64)
        step_rows = [[rows[i] for i in ws] for ws, _, _ in sets]
        flat_rows = torch.tensor([r for rs in step_rows for r in rs], dtype=torch.int64)
        at_pos = up.add(pos)
        at_slots = up.add(self.table.req_to_token[flat_rows, pos].to(torch.int64))
        at_keep = [None if len(ws) == len(prev) else up.add(_places(ws, prev)) for ws, prev, _ in sets]
        kv_lens = (pos + 1).split([len(ws) for ws, _, _ in sets])
        metas = self.preparer.decode_steps(step_rows, [k.tolist() for k in kv_lens], up)
        positions, slots = up.get(at_pos), up.get(at_slots)
        steps = []
        start = 0
        for (ws, _, _), meta, keep in zip(sets, metas, at_keep):
            end = start + len(ws)
            steps.append(GuessStep(ws, None if keep is None else up.get(keep), positions[start:end], slots[start:end],
                                   meta))
            start = end
        return (None if at_first is None else up.get(at_first)), steps

    def _guess(self, step: GuessStep, ids: torch.Tensor) -> torch.Tensor:
        """The logits of one guess forward, whose inputs `ids` are the proposals fed back."""
        return self._run(step.attn, ids, step.positions, step.slots)

    def _catch_up(self, rows: list[int], works: list[DraftInput], ends: list[int]) -> torch.Tensor:
        """The draft's forward over each work's unseen tokens (row i's from works[i].start to
        ends[i]); the logits after each work's last."""
        table = self.table
        lens = [len(w.tokens) for w in works]
        slots = torch.cat([table.req_to_token[row, w.start:end] for row, w, end in zip(rows, works, ends)])
        positions = torch.cat([torch.arange(w.start, end, dtype=torch.int64) for w, end in zip(works, ends)])
        ids = torch.tensor([t for w in works for t in w.tokens], dtype=torch.int64)
        n = len(ids)
        if max(lens) > self.catch_up_rows or (self.graphs is not None and not self.graphs.can_run(n)):
            return self._forward(rows, ids, positions, slots, lens, ends, is_decode=False)
        token_rows = [row for row, k in zip(rows, lens) for _ in range(k)]
        logits = self._forward(token_rows, ids, positions, slots, [1] * n, (positions + 1).tolist(), is_decode=True)
        lasts = indptr_of(lens)[1:].to(torch.int64) - 1
        return logits if n == len(works) else logits[to_device(lasts, self.device)]

    def _forward(self, rows: list[int], input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 qo_lens: list[int], kv_lens: list[int], is_decode: bool) -> torch.Tensor:
        """One forward over request-table rows (a catch-up): each row's qo_lens[i] new
        tokens (written at `slots`) ending at kv_lens[i]; the logits after each row's last,
        over the target's ids."""
        up = Uploads(self.device)  # one copy for the forward's host inputs
        at = [up.add(t.to(torch.int64)) for t in (torch.tensor(rows), positions, slots, input_ids)]
        up.send()
        rows_dev, positions, slots, ids = (up.get(i) for i in at)
        meta = self.preparer.attention(is_decode, qo_lens, kv_lens, rows_dev, backend=self.attn_backend)
        return self._run(meta, ids, positions, slots)

    def _run(self, meta: AttnMetadata, ids: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
        """One forward's logits over the target's ids: a decode through its graph where one
        takes the batch, else eagerly (a prefill through the prefill pieces where they take it)."""
        if meta.is_decode and self.graphs is not None and self.graphs.can_run(ids.shape[0]):
            self.graph_forwards += 1
            return self.graphs.replay(meta, ids, positions, slots)[:, : self.vocab_size]
        assert meta.qo_indptr_host is not None
        fb = ForwardBatch(
            input_ids=ids,
            positions=positions,
            out_cache_loc=slots,
            logits_indices=to_device((meta.qo_indptr_host[1:] - 1).to(torch.int64), self.device),
            attn=meta,
            attn_backend=self.attn_backend,
            kv_pool=self.kv_pool,
        )
        if not meta.is_decode and self.prefill_graphs is not None and self.prefill_graphs.can_run(ids.shape[0]):
            self.graph_forwards += 1
            return self.prefill_graphs.forward(ids, fb)[0][:, : self.vocab_size]  # plans the attention itself
        self.attn_backend.begin_forward(meta)
        return self.model(fb)[:, : self.vocab_size]

    def info(self) -> dict[str, int]:
        m = self.model
        return {"spec_draft_layers": m.num_layers, "spec_draft_vocab_size": m.vocab_size,
                "spec_draft_graph_forwards": self.graph_forwards}


class DraftGrammars:
    """The grammars of a step's drafting requests, so that the draft proposes only what
    they allow: each matcher first takes the request's tokens it has not taken yet (it
    takes them lazily, when its next mask is filled), then each proposal, whose next
    mask guides the one after; `rollback` leaves every matcher as it was. Runs on the
    scheduler's thread before the step's masks are filled (the fill owns the matchers
    from then on). A matcher that refuses a token stops guiding its request: its later
    proposals are unmasked, and the verify rows refuse them."""

    def __init__(self, reqs: list[Req], works: list[int]) -> None:
        self.matchers: dict[int, tuple[Any, int]] = {}  # work index -> (matcher, tokens it took)
        self.width = 0
        # The step's grammar rows read their proposals on the host (sgl.sched.runner.grammar_masks).
        self._guided = any(r.grammar is not None for r in reqs)
        for r, i in zip(reqs, works):
            m = r.grammar
            if m is None or r.grammar_after is not None:
                continue
            took = 0
            for t in r.output_ids[r.grammar_seen:]:
                if m.is_terminated() or not m.accept_token(t):
                    break
                took += 1
            else:
                self.matchers[i] = (m, took)
                self.width = r.grammar_width
                continue
            if took:
                m.rollback(took)

    @property
    def guided(self) -> bool:
        """Whether any request's proposals follow its grammar (they are picked on the host)."""
        return self._guided

    def pick(self, logits: torch.Tensor, works: list[int]) -> torch.Tensor:
        """The most likely token of each row (row k: work `works[k]`) its grammar allows,
        on the device; each guided matcher takes its pick (a wait for the device)."""
        guided = [k for k, i in enumerate(works) if i in self.matchers]
        if not guided:
            return logits.argmax(dim=-1)
        mask = torch.full((len(guided), (self.width + 31) // 32), -1, dtype=torch.int32)
        for row, k in enumerate(guided):
            m, _ = self.matchers[works[k]]
            if not m.is_terminated():
                m.fill_next_token_bitmask(mask, row)
        rows = logits[guided].float()
        apply_masks(rows, mask.to(rows.device), self.width)
        logits = logits.float()
        logits[guided] = rows
        picked = logits.argmax(dim=-1)
        out = picked.tolist()
        for k in guided:
            i = works[k]
            m, took = self.matchers[i]
            if m.is_terminated() or not m.accept_token(out[k]):
                if took:
                    m.rollback(took)
                del self.matchers[i]
            else:
                self.matchers[i] = (m, took + 1)
        return picked

    def rollback(self) -> None:
        for m, took in self.matchers.values():
            if took:
                m.rollback(took)
        self.matchers.clear()


def _places(works: list[int], among: list[int]) -> torch.Tensor:
    """Where each of `works` stands in `among` (which holds them all, in the same order)."""
    place = {w: p for p, w in enumerate(among)}
    return torch.tensor([place[w] for w in works], dtype=torch.int64)
