"""Grammar bitmasks for one batch, made while the GPU runs the batch's forward.

At build time `grammar_rows` notes which sampled rows have a grammar. Once the previous
step's results are processed, `MaskFiller.start` (on the scheduler's thread) works out
what each row's matcher must do: take the tokens sampled since its last mask (the
results processing only appends them to `output_ids`: it never waits on a matcher), then
fill the row's mask. The rows are cut into chunks, one per fill thread; each chunk is
two native calls that release the GIL (xgrammar's batch accept, then its batch fill),
so the threads run side by side while the scheduler builds the next batch. `finish`
waits for them and queues the mask's copy to the device.

The per-row bookkeeping stays on the scheduler's thread: Python on a fill thread would
take the GIL in turns with the batch being built, and slow both.

The bitmasks cover the tokenizer's ids (`GrammarRows.width`), not the model's padded
vocabulary: the sampler disallows the columns past them (sgl.sched.grammar says why).

It runs no kernel: the mask is applied by the runner's sampling."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sgl.cache.host_copy import to_device
from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req, beam_offsets
from sgl.sched.runner.prepare_beams import sampled

if TYPE_CHECKING:
    from sgl.sched.runner.model_runner import ModelRunner

FILL_THREADS = 8  # threads taking tokens and filling masks (they overlap the batch's forward)
CHUNK_MIN = 16  # rows per thread at least: below it the hand-off costs more than it saves


@dataclass(slots=True)
class GrammarRows:
    """A batch's grammar rows, known at build time; their bitmasks come later."""

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
    every = len(entries) == len(batch.reqs)  # the logits rows themselves: no gather and scatter
    dev = None if every else to_device(torch.tensor(entries, dtype=torch.int64), runner.device)
    return GrammarRows(dev, entries, reqs, beams, runner.grammar_vocab)


@dataclass(slots=True)
class _Chunk:
    """One fill thread's rows: mask row, matcher, and the one new token it takes first
    (None: nothing new, as on a request's first token or a beam's)."""

    rows: list[int] = field(default_factory=list)
    matchers: list[Any] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)


class _Started:
    __slots__ = ("g", "mask", "errors", "futures")

    def __init__(self, g: GrammarRows, mask: torch.Tensor, errors: dict[int, str],
                 futures: list[Future[dict[int, str]]]) -> None:
        self.g, self.mask, self.errors, self.futures = g, mask, errors, futures


class MaskFiller:
    """Fills one runner's grammar bitmasks: a host buffer allocated once (pinned on
    CUDA; one is enough, since a batch's masks are filled only after the previous
    batch's results were collected, so its copy to the device is done), its threads,
    and one xgrammar batch filler per chunk (each used by one thread at a time)."""

    def __init__(self, device: torch.device, stop_ids: frozenset[int], threads: int = FILL_THREADS) -> None:
        self.device = device
        self.stop_ids = stop_ids
        self.threads = max(1, threads)
        self.buf = torch.empty(0, 0, dtype=torch.int32)
        self.pool: ThreadPoolExecutor | None = None
        self.fillers: list[Any] = []

    def start(self, g: GrammarRows) -> _Started:
        """Plan the rows (scheduler's thread) and start their chunks on the fill threads."""
        mask = self._rows(len(g.reqs), g.width)
        errors: dict[int, str] = {}
        n_chunks = max(1, min(self.threads, len(g.reqs) // CHUNK_MIN))
        chunks = [_Chunk() for _ in range(n_chunks)]
        k = 0
        for j, (r, beam) in enumerate(zip(g.reqs, g.beams)):
            tok: int | None = None
            if r.beam is not None:  # a beam's matchers took their tokens at selection (sgl.sched.beam)
                own = r.beam.matchers
                m = r.grammar if own is None else own[beam]
                ended = m.is_terminated()
            else:
                m = r.grammar
                new = r.output_ids[r.grammar_seen:]
                r.grammar_seen = len(r.output_ids)
                for t in new[:-1]:  # more than one new token (rare: a step it sat out): here, in turn
                    if not m.is_terminated() and not m.accept_token(t):
                        errors[g.batch_rows[j]] = refused(t)
                        break
                tok = new[-1] if new and g.batch_rows[j] not in errors else None
                ended = bool(g.batch_rows[j] in errors)
            if r.finished or ended:
                mask[j] = -1  # all allowed: the request has ended, its token is dropped
                continue
            c = chunks[k]
            k = (k + 1) % n_chunks
            c.rows.append(j)
            c.matchers.append(m)
            c.tokens.append(tok)
        chunks = [c for c in chunks if c.rows]
        if not chunks:
            return _Started(g, mask, errors, [])
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sgl-grammar-mask")
        while len(self.fillers) < len(chunks):
            import xgrammar

            self.fillers.append(xgrammar.BatchGrammarMatcher(max_threads=1))
        futures = [self.pool.submit(self._run, c, mask, self.fillers[i], g.batch_rows) for i, c in enumerate(chunks)]
        return _Started(g, mask, errors, futures)

    def finish(self, s: _Started) -> GrammarFill:
        """Wait for the chunks; the mask goes to the device (queued, on CUDA)."""
        for f in s.futures:
            s.errors.update(f.result())
        return GrammarFill(to_device(s.mask, self.device), s.errors)

    def fill(self, g: GrammarRows) -> GrammarFill:
        return self.finish(self.start(g))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _rows(self, n: int, width: int) -> torch.Tensor:
        words = (width + 31) // 32
        if self.buf.shape[0] < n or self.buf.shape[1] != words:
            self.buf = torch.empty(max(n, 2 * self.buf.shape[0]), words, dtype=torch.int32,
                                   pin_memory=self.device.type == "cuda")
        return self.buf[:n]

    def _run(self, c: _Chunk, mask: torch.Tensor, filler: Any, batch_rows: list[int]) -> dict[int, str]:
        """A fill thread: the chunk's new tokens into their matchers, then its masks."""
        import xgrammar

        errors: dict[int, str] = {}
        took = [(i, t) for i, t in enumerate(c.tokens) if t is not None]
        drop: set[int] = set()
        if took:
            oks = xgrammar.BatchGrammarMatcher.batch_accept_token([c.matchers[i] for i, _ in took],
                                                                  [t for _, t in took])
            for (i, tok), ok in zip(took, oks):
                if not ok:
                    drop.add(i)
                    if not c.matchers[i].is_terminated():  # an ended matcher refuses anything: not an error
                        errors[batch_rows[c.rows[i]]] = refused(tok)
                elif tok in self.stop_ids and c.matchers[i].is_terminated():
                    drop.add(i)  # the grammar is complete: the request ends with this token
        rows, matchers = c.rows, c.matchers
        if drop:
            for i in drop:
                mask[c.rows[i]] = -1
            keep = [i for i in range(len(rows)) if i not in drop]
            rows, matchers = [rows[i] for i in keep], [matchers[i] for i in keep]
        if rows:
            filler.batch_fill_next_token_bitmask(matchers, mask, indices=rows)
        return errors


def refused(tok: int) -> str:
    return f"internal error: the grammar rejected token {tok}, which its own mask allowed"
