"""The sampling state that lives across steps, on the model's device, and the sampling
of one step with it: each request row's last sampled token (the next decode step's
input), its output-token counts for penalties, the engine's random generator and fused
draw, the beams' scores and trie nodes, and the grammar bitmask filler.

`sample` turns one batch's logits into its StepResult: processing (sgl.sched.runner.
sampler), trie and grammar masks, the draw, beam selection and logprobs, all queued on
the device without waiting for it. It decides nothing about requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl.core.logit_processor import CustomLogitProcessor
from sgl.kernels.gumbel_draw import Bitmask
from sgl.kernels.sampling import FusedDraw
from sgl.kernels.trie_mask import trie_advance, trie_mask_
from sgl.sched.models.parallel import TPGroup
from sgl.sched.runner.beam_select import BeamBuffers, select
from sgl.sched.runner.grammar_masks import GrammarFill, MaskFiller, apply_masks
from sgl.sched.runner.sampler import fused_takes, process_logits, sample
from sgl.sched.runner.step import StepResult

if TYPE_CHECKING:
    from sgl.sched.runner.prepare import PreparedBatch


class SamplingState:
    """Sampling's buffers for `rows` request rows over `vocab_size` columns."""

    def __init__(self, device: torch.device, rows: int, vocab_size: int, dtype: torch.dtype, seed: int,
                 eos_ids: frozenset[int], processors: dict[str, CustomLogitProcessor], masks: bool,
                 tp: TPGroup = TPGroup()) -> None:
        self.device = device
        self.tp = tp
        self.rows = rows
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.eos_dev = torch.tensor(sorted(eos_ids), dtype=torch.int64, device=device)
        self.processors = processors
        # The future-token buffer: each request row's last sampled token, read by the next decode step.
        self.next_token = torch.zeros(rows, dtype=torch.int64, device=device)
        # Output-token counts per request row for penalties: allocated when a batch first needs
        # them, each penalised row rewritten from the host at its (re-)prefill, advanced per step.
        self.counts: torch.Tensor | None = None
        self.beams = BeamBuffers(torch.zeros(rows, dtype=torch.float32, device=device),
                                 torch.zeros(rows, dtype=torch.int64, device=device))
        self.generator = torch.Generator(device)
        self.generator.manual_seed(seed)
        self.fused_draw = FusedDraw.ready(device, seed, vocab_size, dtype, masks=masks)
        self.masks = MaskFiller(device, eos_ids)  # a grammar's stop tokens are the model's EOS
        if masks and device.type == "cuda":
            # xgrammar's masking kernel (batches the one-pass draw does not take) builds on its
            # first call: here, not inside the serving loop. Masked rows are float32 copies.
            apply_masks(torch.zeros(1, vocab_size, device=device),
                        torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device), vocab_size)

    def ensure_counts(self) -> None:
        """Allocate the penalty counts (a batch with penalties is being prepared)."""
        if self.counts is None:
            self.counts = torch.zeros(self.rows, self.vocab_size, dtype=torch.int32, device=self.device)

    @torch.inference_mode()
    def sample(self, p: PreparedBatch, all_logits: torch.Tensor, fill: GrammarFill | None,
               table: torch.Tensor) -> StepResult:
        """Queue the rest of one batch after its forward: the sampled next token of each
        request and, when asked, logprobs (log_softmax of the raw logits, before bias,
        penalties and temperature), as device tensors. `table`: the request table's device
        mirror, whose rows beam selection moves. A graph's logits are its output buffer:
        this is queued before the next forward, so it reads them first."""
        logits = all_logits if p.sample_rows is None else all_logits[p.sample_rows]
        counts = None
        if p.sampling.penalties is not None:
            assert self.counts is not None
            if p.counts_reset is not None:
                rows, at_rows, at_ids = p.counts_reset
                self.counts[rows] = 0
                self.counts.index_put_((at_rows, at_ids), torch.ones_like(at_ids, dtype=torch.int32), accumulate=True)
            counts = self.counts[p.rows]
        errors: dict[int, str] = {}
        if p.beam_src is not None:  # beams are scored in log-probabilities, processors included (HF's order)
            logits = logits.to(torch.float32, copy=True)
            logits[p.beam_src] = torch.log_softmax(logits[p.beam_src], dim=-1)
        processed = process_logits(logits, p.sampling, counts, errors)
        bitmask = None
        if fill is not None and fill.errors:
            errors.update(fill.errors)
        sb, fused = p.sampling, self.fused_draw
        if ((g := p.grammar) is not None and not p.tries and p.beam_src is None and fused is not None
                and fused_takes(sb, fused) and fused.one_pass(sb.need_top_k, sb.need_top_p)):
            assert fill is not None  # the draw applies the bitmask in its one read of the logits: no masked copy
            bitmask = Bitmask(fill.mask, g.mask_rows, g.width)
        elif p.tries or g is not None:
            processed = self._mask(processed, logits, p, fill)
        next_ids = sample(processed, p.sampling, self.generator, self.fused_draw, bitmask)
        if not p.sampling.all_greedy:
            # Every rank draws from the same logits, but a filter's normalisation may round
            # apart between runs (FlashInfer's top-k sums atomically): rank 0's draw stands,
            # or the ranks' requests could end apart and their collectives stop matching.
            self.tp.broadcast(next_ids)
        self.next_token[p.rows] = next_ids
        if self.counts is not None:
            self.counts[p.rows, next_ids] += 1
        for tg in p.tries:
            if tg.advance is not None:
                self.beams.node[tg.advance_rows] = trie_advance(
                    tg.trie, self.beams.node[tg.advance_rows], next_ids[tg.advance])
        picks = [select(processed, g, table, self.next_token, self.beams) for g in p.beams]
        out = StepResult(next_ids, errors=errors, beams=picks or None)
        if (lp := p.logprobs) is not None:
            logp = torch.log_softmax(all_logits.float(), dim=-1)
            assert p.sample_rows is not None
            targets = lp.targets.index_put((p.sample_rows,), next_ids)
            out.token = logp.gather(1, targets[:, None])[:, 0]
            if lp.top_k > 0:
                vals, ids = logp.topk(min(lp.top_k, logp.shape[-1]), dim=-1)
                out.top_vals, out.top_ids = vals, ids
            if lp.id_rows is not None:
                out.ids_vals = logp.gather(1, lp.id_rows)
        return out

    def _mask(self, processed: torch.Tensor, logits: torch.Tensor, p: PreparedBatch,
              fill: GrammarFill | None) -> torch.Tensor:
        """Each trie row keeps only its node's children (EOS where a sequence ends), each
        grammar row only the tokens its bitmask allows."""
        if processed is logits and p.beam_src is None:
            processed = processed.to(torch.float32, copy=True)  # never mask the model's own buffer
        nodes = self.beams.node
        for tg in p.tries:
            if tg.init_rows is not None:
                nodes[tg.init_rows] = tg.init_nodes  # type: ignore[assignment]
            rows = processed[tg.entries]
            trie_mask_(rows, tg.trie, nodes[p.rows[tg.entries]], tg.width, self.eos_dev)
            processed[tg.entries] = rows
        if (g := p.grammar) is not None:
            assert fill is not None
            rows = processed if g.entries is None else processed[g.entries]
            apply_masks(rows, fill.mask, g.width)
            if g.entries is not None:
                processed[g.entries] = rows
        return processed

    def close(self) -> None:
        self.masks.close()
