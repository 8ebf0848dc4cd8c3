"""Batch preparation, on the host at build time: every tensor a forward needs (KV
indices and attention metadata with the cascade split of a decode batch, the
sampling batch, the logprob plan, penalty count resets), copied from the request
state so that the scheduler may change it while the batch runs.

Nothing here waits for the device, runs the model or decides which requests run."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from sgl.cache.req_to_token_pool import gather_kv_indices
from sgl.core.host_copy import Uploads, pinned, to_device
from sgl.kernels import triton_runs_on
from sgl.kernels.attention import AttentionBackend, AttnMetadata, CascadeMeta
from sgl.kernels.kv_indices import gather_rows
from sgl.kernels.lora import LoraBatch
from sgl.sched.batch import ScheduleBatch
from sgl.sched.models.forward_batch import PoolRows
from sgl.sched.runner.beam_select import BeamGroup
from sgl.sched.runner.grammar_masks import GrammarRows, grammar_rows
from sgl.sched.runner.prepare_beams import TrieGroup, beam_groups, trie_groups
from sgl.sched.runner.sampler import SamplingBatch

if TYPE_CHECKING:
    from sgl.sched.req import Req
    from sgl.sched.runner.model_runner import ModelRunner

# A decode batch goes through cascade attention when the shared prefix P of its B
# requests makes P * (B - 1) >= this many token reads fewer per layer: enough KV
# traffic (~0.13 GB, ~30 us per layer for 8 KV heads of 128 in bf16) to pay for the
# extra kernel and the merge (~15 us per layer on an H200 at batch 256).
CASCADE_MIN_SAVED_TOKENS = 32768


@dataclass(slots=True)
class LogprobPlan:
    targets: torch.Tensor  # [R] the token each logits row scores (sampled rows filled in at run time)
    top_k: int
    id_rows: torch.Tensor | None  # [R, M] token_ids_logprob per row


@dataclass(slots=True)
class PreparedBatch:
    batch: ScheduleBatch  # what it was prepared from
    rows: torch.Tensor
    input_ids: torch.Tensor | None
    # A mixed batch's request-table row of each input token: where its inputs read on the
    # device (-1 in input_ids) come from. None otherwise (a decode batch reads `rows`).
    input_rows: torch.Tensor | None
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    logits_indices: torch.Tensor
    sample_rows: torch.Tensor | None  # [B] each request's sampled row among the logits rows (logprobs only)
    attn: AttnMetadata
    sampling: SamplingBatch
    logprobs: LogprobPlan | None
    counts_reset: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, (row, id) pairs to count
    beams: list[BeamGroup]  # beam requests' selections, by shape
    beam_src: torch.Tensor | None  # every beam source among the sampled rows (they get log_softmax)
    tries: list[TrieGroup]  # trie-constrained rows, by trie
    grammar: GrammarRows | None  # grammar rows among the sampled rows (their bitmasks come at sampling)
    pool: PoolRows | None = None  # embedding requests' rows to pool (a prefill with any)
    lora: LoraBatch | None = None  # each row's adapter slot (an engine with LoRA adapters)
    # A draft's proposals made on the device: (entries, tokens) of input_ids (-1 on the host).
    proposals: tuple[torch.Tensor, torch.Tensor] | None = None
    # On CUDA, an event queued before the draft's forwards, where the step's GPU work begins
    # (None: it begins with the forward's own kernels).
    started: torch.cuda.Event | None = None


class BatchPreparer:
    """Prepares batches for one runner: it reads the runner's device, request table,
    vocabulary, EOS ids and processors, has the sampling state allocate its penalty
    counts when a batch first needs them, and counts its cascade steps. A decode batch of the same requests in
    the same rows as the last one (the common case: nothing joined, finished or was
    retracted) reuses what depends on them alone: the shared prefix, the sampling and
    the LoRA blocks."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._shared: tuple[tuple, int] = ((), 0)  # (decode batch identity, its shared prefix length)
        self._sampling: tuple[tuple, SamplingBatch | None] = ((), None)  # (decode batch identity, its sampling)
        # (decode batch identity, its LoRA blocks): a request keeps its adapter slot while it holds KV.
        self._lora: tuple[tuple, LoraBatch | None] = ((), None)
        self.cascade_steps = 0  # decode steps that ran cascade attention
        self._one_launch = triton_runs_on(runner.device)  # KV slots gathered by one kernel
        if self._one_launch:  # compiled now, not inside the first request's step
            one = torch.tensor([0, 1], dtype=torch.int32, device=runner.device)
            gather_rows(runner.req_to_token_pool.mirror, one[:1].long(), one, 1)

    def prepare(self, batch: ScheduleBatch,
                proposals: tuple[torch.Tensor, torch.Tensor] | None = None) -> PreparedBatch:
        """`proposals`: a draft's, made on the device, for the forward to put in its inputs."""
        r = self.runner
        dev = r.device
        reqs = batch.reqs
        rows = torch.tensor(batch.rows, dtype=torch.int64)
        kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int64)
        r.req_to_token_pool.sync()
        qo_indptr = indptr_of(batch.qo_lens)
        logits_rows = (qo_indptr[1:] - 1).to(torch.int64)
        sample_rows = None
        lp = None
        if any(q.return_logprob for q in reqs):
            logits_rows, sample_rows, lp = self._logprob_plan(batch, qo_indptr)
        # The batch's own tensors go in one copy (the attention metadata's in another).
        up = Uploads(dev)
        at = [up.add(t) for t in (rows, batch.positions, batch.out_cache_loc, logits_rows)]
        at_ids = None if batch.input_ids is None else up.add(torch.tensor(batch.input_ids, dtype=torch.int64))
        at_sample = None if sample_rows is None else up.add(sample_rows)
        mixed_inputs = batch.device_inputs and not batch.is_decode
        at_inputs = up.add(rows.repeat_interleave(torch.tensor(batch.qo_lens))) if mixed_inputs else None
        up.send()
        rows_dev, positions, out_cache_loc, logits_indices = (up.get(i) for i in at)
        key = (tuple(batch.rows), tuple(q.rid for q in reqs), tuple(batch.epochs)) if batch.is_decode else ()
        # The shared prefix matters to cascade attention and to a backend's choice of decode kernel.
        wanted = r.cascade or len(r.attn_backend.decode_kernels(len(batch.rows))) > 1
        shared = self._shared_len(reqs, key, rows, kv_lens) if key and len(batch.rows) > 1 and wanted else 0
        cascade = None
        if shared and r.cascade:
            cascade = self._cascade(batch.rows, shared, key, rows_dev, kv_lens)
        elif batch.decode_from is not None and r.cascade:
            cascade = self._mixed_cascade(batch, rows, rows_dev, kv_lens)
        meta = self.attention(batch.is_decode, batch.qo_lens, batch.kv_lens, rows_dev, cascade, shared,
                              batch.decode_from)
        same = self._sampling[1] if key and self._sampling[0] == key else None
        sampling = SamplingBatch.from_reqs(reqs, r.vocab_size, dev, r.eos_ids, r.processors, batch.decode_start,
                                           same_as=same, ahead=batch.draft_index)
        self._sampling = (key, sampling if key else None)
        pooled = batch.pooled_entries if not batch.is_decode else None
        if sampling.penalties is not None:
            r.sampling.ensure_counts()
        reset = None
        if sampling.penalties is not None and not batch.is_decode:
            # A prefilled request's counts start again from its outputs (a retracted one's).
            pen = [i for i, q in enumerate(reqs[: batch.decode_start]) if q.sampling_params.has_penalties]
            pairs = [(batch.rows[i], t) for i in pen for t in reqs[i].output_ids]
            reset = (self._dev(torch.tensor([batch.rows[i] for i in pen], dtype=torch.int64)),
                     self._dev(torch.tensor([q[0] for q in pairs], dtype=torch.int64)),
                     self._dev(torch.tensor([q[1] for q in pairs], dtype=torch.int64)))
        beams = beam_groups(batch, r) if any(q.beam is not None for q in reqs) else []
        tries = trie_groups(batch, r) if any(q.trie is not None for q in reqs) else []
        return PreparedBatch(
            beams=beams,
            beam_src=torch.cat([g.src for g in beams]) if beams else None,
            tries=tries,
            grammar=grammar_rows(batch, dev) if any(q.grammar is not None for q in reqs) else None,
            batch=batch,
            rows=rows_dev,
            input_ids=None if at_ids is None else up.get(at_ids),
            input_rows=None if at_inputs is None else up.get(at_inputs),  # each input token's row
            positions=positions,
            out_cache_loc=out_cache_loc,
            logits_indices=logits_indices,
            sample_rows=None if at_sample is None else up.get(at_sample),
            attn=meta,
            sampling=sampling,
            logprobs=lp,
            counts_reset=reset,
            pool=self._pool_rows(batch, pooled) if pooled else None,
            lora=self._lora_batch(batch, key) if r.lora_spec is not None else None,
            proposals=proposals,
        )

    def attention(self, is_decode: bool, qo_lens: list[int], kv_lens: list[int], rows_dev: torch.Tensor,
                  cascade: CascadeMeta | None = None, shared: int = 0, decode_from: int | None = None,
                  backend: AttentionBackend | None = None) -> AttnMetadata:
        """The attention metadata of request-table rows `rows_dev`: row i's qo_lens[i] new
        tokens over its first kv_lens[i] slots, or over `cascade`'s split; an extend's cached
        prefixes apart where `backend` (None: the runner's) reads them so, those of its rows
        before `decode_from` alone in a mixed batch (the rest are decode rows). The table's
        mirror must be synced."""
        table = self.runner.req_to_token_pool.mirror
        qo_indptr = self._host(indptr_of(qo_lens))
        kv_indptr = self._host(indptr_of(kv_lens))
        extends = len(qo_lens) if decode_from is None else decode_from
        prefix_lens = [k - q for k, q in zip(kv_lens[:extends], qo_lens[:extends])]
        apart = (not is_decode and any(prefix_lens)
                 and (backend or self.runner.attn_backend).reads_prefixes_apart(int(qo_indptr[-1])))
        prefix_indptr = self._host(indptr_of(prefix_lens)) if apart else None
        up = Uploads(self.runner.device)
        at = [up.add(qo_indptr), up.add(kv_indptr)]
        at_prefix = None if prefix_indptr is None else up.add(prefix_indptr)
        up.send()
        kv_indptr_dev = up.get(at[1])
        meta = AttnMetadata(
            is_decode=is_decode,
            qo_indptr=up.get(at[0]),
            kv_indptr=kv_indptr_dev,
            kv_indices=(self._slots(table, rows_dev, kv_indptr_dev, int(kv_indptr[-1]))
                        if cascade is None or decode_from is not None
                        else torch.empty(0, dtype=torch.int32, device=self.runner.device)),
            qo_lens=qo_lens,
            kv_lens=kv_lens,
            kv_indptr_host=kv_indptr,
            qo_indptr_host=qo_indptr,
            cascade=cascade,
            shared_len=shared,
            decode_from=decode_from,
        )
        if prefix_indptr is not None and at_prefix is not None:
            meta.prefix_indptr_host = prefix_indptr
            meta.prefix_lens_host = self._host(torch.tensor(prefix_lens, dtype=torch.int32))
            meta.prefix_indices = self._slots(table, rows_dev[:extends], up.get(at_prefix), int(prefix_indptr[-1]))
        return meta

    def decode_steps(self, rows: list[list[int]], kv_lens: list[list[int]], up: Uploads) -> list[AttnMetadata]:
        """The attention metadata of several decode forwards known before the first runs
        (a draft's guess forwards): forward s runs request-table rows rows[s], each one new
        token over its first kv_lens[s][i] slots. Adds their inputs to the caller's `up` and
        sends it (one copy for them all, the caller's tensors too), and gathers every
        forward's KV slots in one go. The table's mirror must be synced."""
        every = [k for lens in kv_lens for k in lens]
        at_rows = up.add(torch.tensor([r for rs in rows for r in rs], dtype=torch.int64))
        at_every = up.add(indptr_of(every))
        hosts = [(self._host(torch.arange(len(rs) + 1, dtype=torch.int32)), self._host(indptr_of(lens)))
                 for rs, lens in zip(rows, kv_lens)]
        at = [(up.add(qo), up.add(kv)) for qo, kv in hosts]
        up.send()
        slots = self._slots(self.runner.req_to_token_pool.mirror, up.get(at_rows), up.get(at_every), sum(every))
        metas = []
        start = 0
        for lens, (qo, kv), (at_qo, at_kv) in zip(kv_lens, hosts, at):
            end = start + int(kv[-1])
            metas.append(AttnMetadata(True, up.get(at_qo), up.get(at_kv), slots[start:end], [1] * len(lens), lens,
                                      kv_indptr_host=kv, qo_indptr_host=qo))
            start = end
        return metas

    def _slots(self, table: torch.Tensor, rows_dev: torch.Tensor, indptr_dev: torch.Tensor,
               total: int, start: int = 0) -> torch.Tensor:
        """Each row's indptr[i + 1] - indptr[i] slots of `table` from column `start` on,
        concatenated: one launch on a GPU (sgl.kernels.kv_indices), torch's ops elsewhere;
        none for a model that never attends (the null model)."""
        if not self.runner.attends:
            return torch.empty(0, dtype=table.dtype, device=table.device)
        if self._one_launch:
            return gather_rows(table, rows_dev, indptr_dev, total, start)
        return gather_kv_indices(table, rows_dev, torch.full_like(rows_dev, start), indptr_dev.diff().long(), total)

    def _lora_batch(self, batch: ScheduleBatch, key: tuple) -> LoraBatch:
        """Each row's adapter slot, in blocks; reused for a decode batch of the same requests."""
        if key and self._lora[0] == key and self._lora[1] is not None:
            return self._lora[1]
        lora = LoraBatch.from_runs([q.lora_slot for q in batch.reqs], batch.qo_lens, self.runner.device,
                                   self.runner.lora_triton)
        self._lora = (key, lora if key else None)
        return lora

    def _pool_rows(self, batch: ScheduleBatch, entries: list[int]) -> PoolRows:
        """The packed rows the `entries` pool (batch.pooled_entries), each one's in order."""
        ends = list(accumulate(batch.qo_lens))
        rows: list[int] = []
        last: list[int] = []
        for i in entries:
            pooled = batch.reqs[i].pooled
            assert pooled is not None
            first = ends[i] - batch.qo_lens[i] if pooled.mode == "mean" else ends[i] - 1
            rows.extend(range(first, ends[i]))
            last.append(len(rows) - 1)
        return PoolRows(self._dev(torch.tensor(rows, dtype=torch.int64)),
                        self._dev(torch.tensor(last, dtype=torch.int64)))

    def _logprob_plan(self, batch: ScheduleBatch,
                      qo_indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, LogprobPlan]:
        """The logits rows to compute (each request's prompt rows that give logprobs, then
        its sampled row), where each request's sampled row is among them, and the plan."""
        reqs = batch.reqs
        idx: list[int] = []
        targets: list[int] = []
        for i, (r, (a, k)) in enumerate(zip(reqs, batch.lp_in)):
            base = int(qo_indptr[i]) - (batch.kv_lens[i] - batch.qo_lens[i])  # packed row of position 0
            idx.extend(range(base + a, base + a + k))
            targets.extend(r.origin_input_ids[a + 1 : a + 1 + k])
            idx.append(int(qo_indptr[i + 1]) - 1)
            targets.append(0)  # the sampled token, filled in on the device
        logits_rows = torch.tensor(idx, dtype=torch.int64)
        sample_rows = torch.tensor([k for _, k in batch.lp_in], dtype=torch.int64).add_(1).cumsum_(0).sub_(1)
        m = max((len(r.token_ids_logprob or ()) for r in reqs), default=0)
        id_rows = None
        if m:
            # Each row of a request asks for that request's ids (padded with id 0, dropped on the host).
            per_req = [(r.token_ids_logprob or []) + [0] * (m - len(r.token_ids_logprob or [])) for r in reqs]
            counts = [k + 1 for _, k in batch.lp_in]
            id_rows = self._dev(torch.tensor([row for row, c in zip(per_req, counts) for _ in range(c)]))
        lp = LogprobPlan(self._dev(torch.tensor(targets, dtype=torch.int64)),
                         max(r.top_logprobs_num for r in reqs), id_rows)
        return logits_rows, sample_rows, lp

    def _shared_len(self, reqs: list[Req], key: tuple, rows: torch.Tensor, kv_lens: torch.Tensor) -> int:
        """The KV slots every decode row (two rows or more) begins with, short of each
        row's last. Cached per batch identity: a running request's first slots never
        change while it decodes."""
        if self._shared[0] != key:
            limit = int(kv_lens.min()) - 1
            # Past its prompt a beam's host row may lag its device row (beams move on the device).
            limit = min([limit, *(len(q.origin_input_ids) for q in reqs if q.beam is not None)])
            self._shared = (key, shared_prefix_len(self.runner.req_to_token_pool.req_to_token, rows, limit))
        return self._shared[1]

    def _cascade(self, rows: list[int], p: int, key: tuple, rows_dev: torch.Tensor,
                 kv_lens: torch.Tensor) -> CascadeMeta | None:
        """The split of decode rows `rows` over their p shared slots when reading them once
        saves enough (see CASCADE_MIN_SAVED_TOKENS), else None."""
        if p * (len(rows) - 1) < CASCADE_MIN_SAVED_TOKENS:
            return None
        table = self.runner.req_to_token_pool.mirror
        self.cascade_steps += 1
        indptr = self._host(indptr_of((kv_lens - p).tolist()))
        own = self._slots(table, rows_dev, self._dev(indptr), int(indptr[-1]), start=p)
        return CascadeMeta(p, table[rows[0], :p].clone(), indptr, own, (key, p))

    def _mixed_cascade(self, batch: ScheduleBatch, rows: torch.Tensor, rows_dev: torch.Tensor,
                       kv_lens: torch.Tensor) -> CascadeMeta | None:
        """A mixed batch's decode rows split as a decode step of those rows would be (a chat's
        system prompt, read once for them all rather than once a row); None when they share
        too little."""
        d = batch.decode_from
        assert d is not None
        if len(batch.rows) - d < 2:
            return None
        key = ("mixed", tuple(batch.rows[d:]), tuple(q.rid for q in batch.reqs[d:]), tuple(batch.epochs[d:]))
        p = self._shared_len(batch.reqs[d:], key, rows[d:], kv_lens[d:])
        return self._cascade(batch.rows[d:], p, key, rows_dev[d:], kv_lens[d:]) if p else None

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return pinned(t, self.runner.device)

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.runner.device)


def indptr_of(lens: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32 on the host."""
    return torch.tensor([0, *accumulate(lens)], dtype=torch.int32)


def shared_prefix_len(req_to_token: torch.Tensor, rows: torch.Tensor, limit: int) -> int:
    """How many leading slots (at most `limit`) all the given rows have in common."""
    if limit <= 0:
        return 0
    first = req_to_token[rows, 0]
    if bool((first != first[0]).any()):
        return 0  # the usual batch without a shared prefix: one column read, not [B, limit]
    block = req_to_token[rows, :limit]
    differs = (block != block[:1]).any(dim=0)
    return int(differs.int().argmax()) if bool(differs.any()) else limit
