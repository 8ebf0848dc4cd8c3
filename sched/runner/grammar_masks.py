"""Grammar bitmasks for one batch, made while the GPU runs the batch's forward.

At build time `grammar_rows` notes which sampled rows have a grammar. Once the previous
step's tokens are on the host (given apart while they are processed, or already appended
to `output_ids`), `MaskFiller.start` on the scheduler's thread notes each row's tokens
sampled since its last mask and hands the rest to the fill thread: two native calls, the
matchers' accepts (xgrammar's batch accept, its result read in one call: `accept_all`)
and the fill (its batch fill over FILL_THREADS native threads), with a few lines of
Python between them. The scheduler meanwhile processes the results and builds and
prepares the next batch; `finish` waits for both and queues the mask's copy to the
device (sgl.sched.runner.step.Step's two hooks). `times` keeps where each step's
grammar time went (the scheduler's server info shows it).

Why so (an H200's host, 256 rows of a JSON schema): the accepts take ~1 ms and the fill
~1.3 ms, both GIL-free, and the scheduler's thread waits for them only at `finish`,
after building the next batch. Python on the fill thread waits for the GIL while the
scheduler's thread runs Python, up to the interpreter's switch interval at each turn:
at the default 5 ms the accepts did better on the scheduler's thread, so the
scheduler's own process runs with a 0.2 ms interval (sgl.runtime.child); a scheduler
in the caller's process (the in-process transport) keeps the caller's setting.

The bitmasks cover the tokenizer's ids (`GrammarRows.width`), not the model's padded
vocabulary: the sampler disallows the columns past them (sgl.sched.grammar says why).

It runs no kernel: the mask is applied by the runner's sampling."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sgl.core.host_copy import to_device
from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req, beam_offsets
from sgl.sched.runner.prepare_beams import sampled
from sgl.sched.runner.sampler import min_tokens_ban

FILL_THREADS = 8  # xgrammar's native threads filling a batch's masks (they overlap the batch's forward)
CHUNK_MIN = 16  # rows from which those threads pay (8 rows: 0.48 ms threaded, 0.27 alone)


@dataclass(slots=True)
class GrammarRows:
    """A batch's grammar rows, known at build time; their bitmasks come later."""

    entries: torch.Tensor | None  # [g] the grammar rows among the sampled logits rows, on the device; None: all
    mask_rows: torch.Tensor | None  # [B] int32 each sampled row's mask row, -1 for none, on the device; None: all
    batch_rows: list[int]  # the same rows on the host (the batch's entries, for StepResult.errors)
    reqs: list[Req]
    beams: list[int]  # each row's beam within its request (0 for a plain request)
    width: int  # the bitmask's token ids (the tokenizer's): logits columns past it are never allowed
    # A speculative step's rows: each row's place among its request's rows (0: its last token;
    # j: proposed token j, its input `inputs[row]`); None for any other batch.
    ahead: list[int] | None = None
    inputs: list[int] | None = None


@dataclass(slots=True)
class GrammarFill:
    """A batch's filled bitmasks (on the device) and the rows whose request must end:
    a token its own mask allowed that the matcher then refused (an internal error)."""

    mask: torch.Tensor
    errors: dict[int, str]


def apply_masks(rows: torch.Tensor, mask: torch.Tensor, width: int) -> None:
    """Keep in each logits row only the token ids its bitmask row allows: `width` ids (the
    tokenizer's) are masked, the model's padded columns past them are never allowed."""
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(rows, mask, vocab_size=width)
    if width < rows.shape[1]:
        rows[:, width:] = float("-inf")


def grammar_rows(batch: ScheduleBatch, device: torch.device) -> GrammarRows | None:
    """The batch's grammar rows, or None when no sampled row has a grammar."""
    entries: list[int] = []
    reqs: list[Req] = []
    beams: list[int] = []
    for i, (r, beam) in enumerate(zip(batch.reqs, beam_offsets(batch.reqs))):
        if r.grammar is not None and sampled(batch, i):
            entries.append(i)
            reqs.append(r)
            beams.append(beam)  # a speculating request's proposal rows count on, unread (`ahead`)
    if not entries:
        return None
    ahead = inputs = None
    if (spec := batch.draft_index) is not None:
        assert batch.input_ids is not None
        ahead = [spec[i] for i in entries]
        inputs = [batch.input_ids[i] for i in entries]
    every = len(entries) == len(batch.reqs)  # the logits rows themselves: no gather and scatter
    dev = mask_rows = None
    if not every:
        dev = to_device(torch.tensor(entries, dtype=torch.int64), device)
        inverse = torch.full((len(batch.reqs),), -1, dtype=torch.int32)
        inverse[entries] = torch.arange(len(entries), dtype=torch.int32)
        mask_rows = to_device(inverse, device)
    return GrammarRows(dev, mask_rows, entries, reqs, beams, reqs[0].grammar_width, ahead, inputs)


@dataclass(slots=True)
class StartedFill:
    mask: torch.Tensor
    errors: dict[int, str]
    future: Future[None] | None  # the fill, when on the fill thread


class MaskFiller:
    """Fills one runner's grammar bitmasks: a host buffer allocated once (pinned on
    CUDA; one is enough, since a batch's masks are filled only after the previous
    batch's results were collected, so its copy to the device is done), the fill thread
    and xgrammar's batch fillers (FILL_THREADS native threads; one for small batches)."""

    def __init__(self, device: torch.device, stop_ids: frozenset[int]) -> None:
        self.device = device
        self.stop_ids = stop_ids
        self.threads = fill_threads()
        self.buf = torch.empty(0, 0, dtype=torch.int32)
        self.pool: ThreadPoolExecutor | None = None
        self.fillers: dict[int, Any] = {}
        # Seconds, summed over steps: `start` on the caller's thread; on the fill thread,
        # the accepts' and the fill's native calls and the whole turn (GIL waits included);
        # the queueing of the sampling once the masks are in (sgl.sched.runner.step.Step.sample).
        self.times = {"mask_start_s": 0.0, "mask_accept_s": 0.0, "mask_fill_s": 0.0, "mask_thread_s": 0.0,
                      "sample_queue_s": 0.0}

    def start(self, g: GrammarRows, just: dict[Req, int] | None = None, background: bool = True) -> StartedFill:
        """Note each row's new token here, then give the matchers their tokens and fill
        the bitmasks (on the fill thread when `background`, else here). `just`: tokens
        sampled but not yet in their requests' output_ids (they are being processed:
        sgl.sched.results.Outcomes.grammar_tokens). Until `finish`, the fill thread owns these
        matchers: nothing else may call them."""
        t0 = time.perf_counter()
        mask = self._rows(len(g.reqs), g.width)
        errors: dict[int, str] = {}
        rows: list[int] = []  # mask rows to fill, and their matchers
        matchers: list[Any] = []
        took: list[int] = []  # of those, the ones taking one new token, and the tokens
        tokens: list[int] = []
        # Rows left all-allowed: the request ended (its token is dropped), or its matcher, or it
        # is still reasoning (its grammar starts after the end of its reasoning).
        ended: list[int] = []
        short: list[tuple[int, list[int]]] = []  # rows short of min_new_tokens, and the ids banned till then
        for j, r in enumerate(g.reqs):
            if g.ahead is not None and g.ahead[j]:
                continue  # a proposal's row: filled after its request's first (`_fill_ahead`)
            if r.finished_reason is not None:
                ended.append(j)
                continue
            if r.beam is None:
                m = r.grammar
                out, seen = r.output_ids, r.grammar_seen
                n = len(out)
                tok = just.get(r) if just else None
                if tok is None and n > seen:  # the newest token goes with the batch's accepts
                    n -= 1
                    tok = out[n]
                if r.grammar_after is not None:  # still reasoning: its row stays all-allowed
                    after = self._after_reasoning(r, [*out[seen:n], *([] if tok is None else [tok])])
                    if after is None:
                        ended.append(j)
                        continue
                    if after:
                        bad = self._accept_each(m, after[:-1])
                        if bad is not None:
                            errors[g.batch_rows[j]] = refused(m, bad, g.width, r)
                            ended.append(j)
                            continue
                        took.append(len(rows))
                        tokens.append(after[-1])
                elif tok is not None:
                    r.grammar_seen = n + 1
                    if n > seen:  # rare: tokens of a step it sat out
                        bad = self._accept_each(m, out[seen:n])
                        if bad is not None:
                            errors[g.batch_rows[j]] = refused(m, bad, g.width, r)
                            ended.append(j)
                            continue
                    took.append(len(rows))
                    tokens.append(tok)
                if len(out) + (just is not None and r in just) < r.sampling_params.min_new_tokens:
                    short.append((j, min_tokens_ban(r.sampling_params, self.stop_ids)))
            else:  # a beam's matchers took their tokens at selection (sgl.sched.beam)
                own = r.beam.matchers
                m = r.grammar if own is None else own[g.beams[j]]
                if m.is_terminated():
                    ended.append(j)
                    continue
            rows.append(j)
            matchers.append(m)
        if ended:
            mask[ended] = -1
        if g.ahead is not None:
            mask[[j for j, a in enumerate(g.ahead) if a]] = -1  # all allowed unless `_fill_ahead` fills them
        if not rows:
            return StartedFill(mask, errors, None)

        entered = threading.Event()
        times = self.times

        def accept_and_fill() -> None:
            entered.set()  # first: whatever raises below reaches `finish`, never a waiting `start`
            nonlocal rows, matchers
            t1 = time.perf_counter()
            if took:
                oks = accept_all([matchers[i] for i in took], tokens)
                t2 = time.perf_counter()
                times["mask_accept_s"] += t2 - t1
                if oks is not None or any(t in self.stop_ids for t in tokens):
                    rows, matchers = self._drop_ended(g, mask, errors, rows, matchers, took, tokens,
                                                      oks or [True] * len(took))
            if rows:
                t2 = time.perf_counter()
                self._filler(len(rows)).batch_fill_next_token_bitmask(matchers, mask, indices=rows)
                if g.ahead is not None:
                    self._fill_ahead(g, mask, rows, matchers)
                if short:
                    self._end_short(g, mask, errors, rows, short)
                times["mask_fill_s"] += time.perf_counter() - t2
            times["mask_thread_s"] += time.perf_counter() - t1

        if not background:
            accept_and_fill()
            return StartedFill(mask, errors, None)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="sgl-grammar-mask")
        future = self.pool.submit(accept_and_fill)
        entered.wait()  # blocked, this thread lets the fill thread take the GIL and reach the native calls
        times["mask_start_s"] += time.perf_counter() - t0
        return StartedFill(mask, errors, future)

    def finish(self, s: StartedFill) -> GrammarFill:
        """Wait for the accepts and the fill; the mask goes to the device (queued, on
        CUDA). The errors are complete only now."""
        if s.future is not None:
            s.future.result()
        return GrammarFill(to_device(s.mask, self.device), s.errors)

    def fill(self, g: GrammarRows) -> GrammarFill:
        """All of it now, on this thread (a batch launched without overlap)."""
        return self.finish(self.start(g, background=False))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _rows(self, n: int, width: int) -> torch.Tensor:
        words = (width + 31) // 32
        if self.buf.shape[0] < n or self.buf.shape[1] != words:
            self.buf = torch.empty(max(n, 2 * self.buf.shape[0]), words, dtype=torch.int32,
                                   pin_memory=self.device.type == "cuda")
        return self.buf[:n]

    def _filler(self, rows: int) -> Any:
        """xgrammar's batch filler: FILL_THREADS native threads from CHUNK_MIN rows, else one
        (one matcher's fill takes ~15 us of CPU for a 49k vocabulary: 4 ms for 256 alone)."""
        threads = self.threads if rows >= CHUNK_MIN else 1
        if threads not in self.fillers:
            import xgrammar

            self.fillers[threads] = xgrammar.BatchGrammarMatcher(max_threads=threads)
        return self.fillers[threads]

    @staticmethod
    def _fill_ahead(g: GrammarRows, mask: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """A speculative step's proposal rows: row j's mask is the matcher's after its
        request's proposals 1..j, taken in turn and then rolled back. From a proposal the
        grammar refuses on, the rows keep the mask before it: the row before refuses that
        proposal, so nothing sampled past it is taken (only a mask that allows something
        is needed there)."""
        assert g.ahead is not None and g.inputs is not None
        n = len(g.reqs)
        for first, m in zip(rows, matchers):  # each request's first row, filled already
            taken, j = 0, first + 1
            while j < n and g.ahead[j]:
                if taken == j - first - 1 and not m.is_terminated() and m.accept_token(g.inputs[j]):
                    taken += 1  # every proposal so far taken
                if taken == j - first and not m.is_terminated():
                    m.fill_next_token_bitmask(mask, j)
                else:
                    mask[j] = mask[j - 1]
                j += 1
            if taken:
                m.rollback(taken)

    @staticmethod
    def _end_short(g: GrammarRows, mask: torch.Tensor, errors: dict[int, str], rows: list[int],
                   short: list[tuple[int, list[int]]]) -> None:
        """Rows short of min_new_tokens whose grammar allows nothing but the ids banned until
        then (it can only end): nothing is left to draw, so the request ends now, with an
        error that says why, and this step's token is dropped (its mask all-allowed)."""
        filled = set(rows)
        for j, banned in short:
            if j in filled and not allows_besides(mask[j], banned):
                r = g.reqs[j]
                errors[g.batch_rows[j]] = (f"{grammar_kind(r)}: the grammar can only end after the output so far, "
                                           f"and min_new_tokens={r.sampling_params.min_new_tokens} bans the end: ask "
                                           "for fewer tokens than the grammar allows")
                mask[j] = -1

    @staticmethod
    def _after_reasoning(r: Req, new: list[int]) -> list[int] | None:
        """The request's tokens since its last mask (`new`, all taken now) that follow its
        end of reasoning, or None while it goes on; once it came the matcher starts."""
        r.grammar_seen += len(new)
        if r.grammar_after not in new:
            return None
        after = new[new.index(r.grammar_after) + 1:]
        r.grammar_after = None
        return after

    @staticmethod
    def _accept_each(m: Any, tokens: list[int]) -> int | None:
        """The tokens into the matcher in turn; the one it refused, or None."""
        for t in tokens:
            if not m.is_terminated() and not m.accept_token(t):
                return t
        return None

    def _drop_ended(self, g: GrammarRows, mask: torch.Tensor, errors: dict[int, str], rows: list[int],
                    matchers: list[Any], took: list[int], tokens: list[int],
                    oks: list[bool]) -> tuple[list[int], list[Any]]:
        """The rows not to fill after the accepts: a refused token (an error, unless the
        matcher had ended: an ended matcher refuses anything) or a complete grammar (the
        request ends with this token). Their masks are left all-allowed."""
        drop: set[int] = set()
        for i, tok, ok in zip(took, tokens, oks):
            m = matchers[i]
            if not ok:
                drop.add(i)
                if not m.is_terminated():
                    errors[g.batch_rows[rows[i]]] = refused(m, tok, g.width, g.reqs[rows[i]])
            elif tok in self.stop_ids and m.is_terminated():
                drop.add(i)
        for i in drop:
            mask[rows[i]] = -1
        keep = [i for i in range(len(rows)) if i not in drop]
        return [rows[i] for i in keep], [matchers[i] for i in keep]


def fill_threads() -> int:
    """FILL_THREADS, at most the machine's cores (xgrammar warns past them)."""
    return max(1, min(FILL_THREADS, os.cpu_count() or 1))


def accept_all(matchers: list[Any], tokens: list[int]) -> list[bool] | None:
    """Each matcher takes its token (xgrammar's batch accept): None when all of them
    did, else whether each did. Why not xgrammar's own wrapper: it reads the result
    one element at a time, a call into xgrammar's FFI each, and every such call lets
    go of the GIL and must take it back from the scheduler's thread (up to its switch
    interval, each time): 256 of them made the fill thread's step twice as long as the
    native work (measured on an H200's host). One call asks whether any was refused."""
    try:
        from xgrammar.base import _core

        handles = [m._handle for m in matchers]
    except (ImportError, AttributeError):  # an xgrammar laid out otherwise: its wrapper
        import xgrammar

        oks = xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return None if all(oks) else oks
    got = _core.BatchGrammarMatcher.batch_accept_token(handles, tokens, False)
    return None if 0 not in got else [bool(ok) for ok in got]


def allows_any(matcher: Any, width: int) -> bool:
    """Whether the matcher allows some next token (EOS included). One fill of a bitmask:
    for a grammar's first check and for explaining a refusal, never per step."""
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, width)
    matcher.fill_next_token_bitmask(mask)
    return bool(mask.any())


def allows_besides(row: torch.Tensor, ids: list[int]) -> bool:
    """Whether a host bitmask row allows some token other than `ids`."""
    bits = row.numpy().view(np.uint32).copy()
    for t in ids:
        if t >> 5 < bits.size:
            bits[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
    return bool(bits.any())


def refused(m: Any, tok: int, width: int, r: Req) -> str:
    """Why matcher `m` of request `r` refused a token drawn under its own mask: a dead end
    of the caller's grammar (its mask allowed nothing, so any draw was refused), else an
    internal error."""
    if not allows_any(m, width):
        return (f"{grammar_kind(r)}: the grammar allows no token after the output so far: no text it matches "
                "continues it")
    return f"internal error: the grammar rejected token {tok}, which its own mask allowed"


def grammar_kind(r: Req) -> str:
    """The request's field its grammar came from (json_schema, regex or ebnf), for its errors."""
    g = r.sampling_params.grammar
    return g[0] if g is not None else "grammar"
