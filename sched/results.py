"""A step's results applied to its requests, and a failed step's requests ended.

Each entry of a collected step gets one `Outcome`, decided once (`Outcomes`): the
matchers of the next grammar batch take exactly the TOKEN entries' tokens, and
processing follows the same list: each request's sampled token and logprobs
appended, finished requests ended (stop token, stop string, length, context),
prefilled requests moved to running (under the overlap loop most run from their last
chunk's launch already: DecodeManager.join). A step that fails (prepare, forward, sampling,
its results) ends its requests with an abort reason (retracted once first on a CUDA
OOM), and KV that was never written is dropped from the radix tree. The Outbox
turns what finished or streamed into the BatchTokenIDOutput the detokenizer gets.

Nothing here builds or launches batches, and nothing here decodes text."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from sgl.core.log import get_logger
from sgl.core.protocol import BatchTokenIDOutput, Logprobs
from sgl.sched.batch import ScheduleBatch
from sgl.sched.beam import BeamSearch
from sgl.sched.decode import DecodeManager
from sgl.sched.kv_cache import KVCache
from sgl.sched.prefill import PrefillManager
from sgl.sched.req import Req
from sgl.sched.runner.step import Step, StepResult
from sgl.sched.stop import StopStrings

MAX_ERROR_CHARS = 300  # of an exception's text in an abort message


class Outcome(enum.Enum):
    """What one batch entry's share of a step's results does to its request."""

    STALE = "stale"  # ended or retracted since the launch (or a beam's or a speculative step's later entry): dropped
    ABORT = "abort"  # an abort is pending, or came with this step's errors: it ends once no batch holds it
    CHUNK = "chunk"  # a middle prefill chunk: prompt logprobs only, no token
    PROMPT = "prompt"  # a prefill-only request's prompt (max_new_tokens=0): logprobs, then it ends
    BEAM = "beam"  # a beam request's selection (its first entry)
    TOKEN = "token"  # it takes the sampled token


class Outcomes:
    """Each entry's Outcome for one step's results, decided once before any is applied.
    Errors the step reports become the requests' pending aborts here."""

    __slots__ = ("batch", "res", "kinds", "tokens")

    def __init__(self, batch: ScheduleBatch, res: StepResult) -> None:
        self.batch = batch
        self.res = res
        self.tokens: list[int] = res.next_ids.tolist()
        for i, message in sorted((res.errors or {}).items()):  # a beam request: its first row's error
            req = batch.reqs[i]
            if req.to_abort is None and not req.finished and req.epoch == batch.epochs[i]:
                req.to_abort = message
        kinds = []
        for i, (req, epoch, partial) in enumerate(zip(batch.reqs, batch.epochs, batch.partial)):
            later = (req.beam is not None and i and batch.reqs[i - 1] is req) or (
                batch.draft_index is not None and batch.draft_index[i] > 0)  # applied with the request's first
            if req.finished or req.epoch != epoch or later:
                kinds.append(Outcome.STALE)
            elif req.to_abort is not None:
                kinds.append(Outcome.ABORT)
            elif partial:
                kinds.append(Outcome.CHUNK)
            elif req.prefill_only:
                kinds.append(Outcome.PROMPT)
            else:
                kinds.append(Outcome.BEAM if req.beam is not None else Outcome.TOKEN)
        self.kinds = kinds

    def grammar_tokens(self) -> dict[Req, int]:
        """The token each grammar request of the batch takes (its matcher takes it before
        the next mask; beams' matchers take theirs at selection)."""
        return {r: t for r, k, t in zip(self.batch.reqs, self.kinds, self.tokens)
                if k is Outcome.TOKEN and r.grammar is not None}


class Outbox:
    """The requests with something to send this turn, sent as one message."""

    def __init__(self) -> None:
        self.reqs: dict[Req, None] = {}  # once each, even if ended twice over
        self.embeddings = False  # one of them has an embedding: the message carries the column

    def add(self, req: Req) -> None:
        self.reqs[req] = None
        if req.embedding is not None:
            self.embeddings = True

    def flush(self, weight_version: str) -> BatchTokenIDOutput | None:
        """The outbox's requests as one message to the detokenizer: each one's ids and
        logprobs since its last message, which are marked sent; None when empty.
        `weight_version`: of the weights that made them."""
        if not self.reqs:
            return None
        reqs, self.reqs = list(self.reqs), {}
        out = BatchTokenIDOutput([], [], [], [], [], [], [], [], [], [], [], [], [], weight_version)
        for r in reqs:
            out.rids.append(r.rid)
            out.new_ids.append(r.output_ids[r.sent_len :])
            r.sent_len = len(r.output_ids)
            out.finished_reasons.append(r.finished_reason)
            out.prompt_tokens.append(len(r.origin_input_ids))
            out.completion_tokens.append(len(r.output_ids))
            out.cached_tokens.append(r.cached_tokens)
            p = r.sampling_params
            out.skip_special_tokens.append(p.skip_special_tokens)
            out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
            out.no_stop_trim.append(p.no_stop_trim)
            out.stop_strs.append(p.stop_strs)
            out.detokenize.append(r.detokenize)
            out.logprobs.append(r.logprobs)
            out.beams.append(r.beam.result if r.beam is not None else None)
            if r.logprobs is not None:
                r.logprobs = Logprobs()
        if self.embeddings:
            self.embeddings = False
            out.embeddings = [r.embedding for r in reqs]
        return out


Finish = Callable[[Req, dict[str, Any]], None]


class ResultProcessor:
    """Applies collected steps to their requests and ends failed steps' requests.
    `finish` and `abort_now` are the scheduler's request ends."""

    def __init__(self, kv: KVCache, prefill: PrefillManager, decode: DecodeManager, beams: BeamSearch,
                 outbox: Outbox, stop_strings: StopStrings, eos_ids: frozenset[int], context_length: int,
                 tp_size: int, finish: Finish, abort_now: Callable[[Req, str], None]) -> None:
        self.kv = kv
        self.prefill = prefill
        self.decode = decode
        self.beams = beams
        self.outbox = outbox
        self.stop_strings = stop_strings
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.tp_size = tp_size
        self.finish = finish
        self.abort_now = abort_now
        self.log = get_logger("scheduler")
        self.failures = 0  # batches and requests ended by an internal error

    def wait(self, step: Step, strike: Callable[[ScheduleBatch, str], None] | None = None) -> Outcomes | None:
        """A launched step's results on the host, each entry's outcome decided; None if the
        step failed (its requests then end). It stops counting in its requests' `inflight`.
        `strike`: raises a planted failure of the forward or of result processing, as
        they would raise here (sgl.sched.faults)."""
        batch = step.batch
        for req in batch.unique_reqs:
            req.inflight -= 1  # first: whatever fails below, this batch holds none of them any more
        try:
            step.sample()  # a grammar step never sampled (shutting down): now
            res = step.result()
            batch.take_proposals()  # a draft's, copied before the results were
            if strike is not None:
                strike(batch, "forward")
        except Exception as e:  # noqa: BLE001 - the forward or sampling failed: that batch's requests end
            self.fail(batch, e, "forward", kv_written=False)
            return None
        try:
            if strike is not None:
                strike(batch, "result processing")
            return Outcomes(batch, res)
        except Exception as e:  # noqa: BLE001 - the whole batch's results are unreadable
            self.fail(batch, e, "result processing", kv_written=True)
            return None

    def apply(self, got: Outcomes | None) -> None:
        """Apply a step's results to its requests. A request whose results raise is
        aborted alone (logged with the traceback); the others go on."""
        if got is None:
            return
        batch, res = got.batch, got.res
        row = -1  # the last logits row of the previous request
        pooled = {i: res.pooled[j] for j, i in enumerate(batch.pooled_entries)} if res.pooled is not None else None
        for i, (req, kind, tok, epoch, (a, k)) in enumerate(
                zip(batch.reqs, got.kinds, got.tokens, batch.epochs, batch.lp_in)):
            first, row = row + 1, row + 1 + (k if res.token is not None else 0)
            if kind is Outcome.STALE or req.finished or req.epoch != epoch:
                continue  # or ended or retracted since the outcomes were decided (a failed next step)
            try:
                if pooled is not None and i in pooled and req.pooled is not None and kind is not Outcome.ABORT:
                    req.pooled.add(pooled[i], batch.qo_lens[i])
                self._apply(batch, res, i, req, kind, tok, first, a, k, got.tokens)
            except Exception as e:  # contained to this request
                self.failures += 1
                self.log.exception("processing a request's results failed: it is aborted", rid=req.rid)
                self.abort_now(req, error_message("result processing", e))

    def _apply(self, batch: ScheduleBatch, res: StepResult, i: int, req: Req, kind: Outcome, tok: int,
               first: int, a: int, k: int, tokens: list[int]) -> None:
        """One request's share of a step's results (`tokens`: every entry's sampled token)."""
        if kind is Outcome.ABORT:
            if req.inflight == 0:
                self.finish(req, {"type": "abort", "message": req.to_abort})
            return
        if req.logprobs is not None and res.token is not None:
            _add_logprobs(req, res, first, a, k, sampled=kind is Outcome.TOKEN)
        if kind is Outcome.CHUNK:
            return
        req.prompt_done = True
        if kind is Outcome.PROMPT:
            # Its prompt logprobs or its pool are in: the token sampled after the prompt is dropped.
            if req.pooled is not None:
                req.embedding = req.pooled.vector()
            self.finish(req, {"type": "length", "length": 0})
            return
        prefilled = batch.prefills(i)
        if prefilled:
            self.prefill.remove(req)
            self.decode.add(req)
        if kind is Outcome.BEAM:
            assert res.beams is not None
            g, n = batch.beam_index[req]
            self.beams.apply(batch, i, req, res.beams[g], n)
            return
        if batch.draft_index is not None:
            self._apply_speculative(batch, res, i, req, tokens)
            return
        req.output_ids.append(tok)
        reason = self._finish_reason(req, tok)
        if prefilled and reason is None:
            self.kv.cache_unfinished(req)  # its prompt is shareable while it decodes
        if reason is not None:
            self.finish(req, reason)
        elif req.stream:
            self.outbox.add(req)

    def _apply_speculative(self, batch: ScheduleBatch, res: StepResult, i: int, req: Req, tokens: list[int]) -> None:
        """A speculative step's rows i.. of one request (its last token, then its proposed
        ones): it takes the sampled tokens up to the first that differs from the proposal
        after it, up to its finish; the KV of the rows past what it took is freed (the
        first row's logprobs are in already)."""
        assert batch.input_ids is not None and batch.draft_index is not None
        n = 1
        while i + n < len(batch.reqs) and batch.draft_index[i + n] > 0:
            n += 1
        sampled = tokens[i : i + n]
        spec = self.decode.speculator
        assert spec is not None
        accepted = spec.accepted(batch.input_ids[i + 1 : i + n], sampled)
        reason = None
        taken = 0
        for e in range(accepted + 1):
            if e and req.logprobs is not None and res.token is not None:
                _add_logprobs(req, res, i + e, 0, 0, sampled=True)
            req.output_ids.append(sampled[e])
            taken += 1
            reason = self._finish_reason(req, sampled[e])
            if reason is not None:
                break
        # Rows 0..taken-1 hold the KV of the last token and the proposals taken before the newest
        # token, whose own KV the next step writes (as in plain decode). A request with proposals
        # steps again only once this is processed (its device input is stale), so its KV ends
        # with this step's rows; one without may be in a later step already, and has none to free.
        if n > 1:
            self.kv.truncate(req, batch.kv_lens[i] - 1 + taken)  # kv_lens[i] - 1: row i's position
        spec.record(req, n - 1, taken)
        if reason is not None:
            self.finish(req, reason)
        elif req.stream:
            self.outbox.add(req)

    def _finish_reason(self, req: Req, tok: int) -> dict[str, Any] | None:
        """Why the request ends with `tok` (just appended to its outputs), or None."""
        p = req.sampling_params
        early = len(req.output_ids) <= p.min_new_tokens  # tok itself was masked if so
        if not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids)):
            return {"type": "stop", "matched": tok}
        if not early and (p.stop_strs or p.stop_regex):
            try:
                s = self.stop_strings.match(req.output_ids, p.stop_strs, p.skip_special_tokens, p.stop_regexes)
            except TimeoutError:
                return {"type": "abort", "status_code": 400,
                        "message": "stop_regex: a pattern took too long to match the output; simplify it"}
            if s is not None:
                return {"type": "stop", "matched": s}
        if req.tokens_left(self.context_length) <= 0:
            n = p.max_new_tokens if len(req.output_ids) >= p.max_new_tokens else len(req.output_ids)
            return {"type": "length", "length": n}
        if req.grammar is not None and req.grammar_after is None and tok in self.eos_ids:
            # The grammar is complete (its mask allows EOS only then), ignore_eos or not. The
            # matcher takes the token before the next mask, never here (sgl.sched.runner.grammar_masks).
            return {"type": "stop", "matched": tok}
        return None

    def fail(self, batch: ScheduleBatch, e: BaseException, stage: str, kv_written: bool) -> None:
        """A batch failed (`stage`: prepare, forward, sampling, result processing): each of
        its requests that this batch still speaks for ends with an abort reason and gives
        its KV back at once, later batches holding it in flight notwithstanding (their
        results are dropped, as after a retraction). On a CUDA OOM a request is retracted
        instead, once: it comes back through admission, recomputed. The caller has taken
        the batch off its requests' `inflight`. `kv_written=False`: the forward may not
        have written the batch's KV, which the tree may share: it is dropped there."""
        if self.tp_size > 1:
            # One rank's failure (an OOM on its GPU) is not the others': containing it would let
            # the ranks' states part and their collectives wait on each other. The rank ends
            # instead, and the engine's watchdog fails every request (and the server exits).
            raise RuntimeError(f"a batch failed on a tensor-parallel rank ({stage}): this rank stops, as the "
                               "ranks can no longer agree") from e
        live = list(dict.fromkeys(r for r, ep in zip(batch.reqs, batch.epochs) if not r.finished and r.epoch == ep))
        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        self.failures += 1
        self.log.exception("a batch failed: its requests are " + ("retracted once" if oom else "aborted"), stage=stage,
                           decode=batch.is_decode, rids=[r.rid for r in live], exc_info=e)
        if oom and torch.cuda.is_available():
            torch.cuda.empty_cache()
        message = error_message(stage, e)
        for r in live:
            if r.finished:
                continue
            if oom and not r.oom_retried:
                r.oom_retried = True
                self.decode.retract(r)
            else:
                self.abort_now(r, message)
        if not kv_written:
            readers = self.kv.reads_unwritten(batch.out_cache_loc, self.decode.holders())
            if readers is not None:
                for r in readers:  # none may read those slots again: recomputed later
                    self.decode.retract(r)
                self.kv.drop_unlocked()


def error_message(stage: str, e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    return f"internal error in {stage} ({type(e).__name__}): {text}"


def _add_logprobs(req: Req, res: StepResult, first: int, a: int, k: int, sampled: bool) -> None:
    """Append this step's rows [first, first + k) (prompt) and, if `sampled`, first + k
    (the sampled token's) to req.logprobs."""
    lp, end = req.logprobs, first + k + (1 if sampled else 0)
    assert lp is not None and res.token is not None
    vals = res.token[first:end].tolist()
    tops = None
    if req.top_logprobs_num and res.top_vals is not None:
        n = req.top_logprobs_num
        tops = (res.top_vals[first:end, :n].tolist(), res.top_ids[first:end, :n].tolist())  # type: ignore[index]
    ids_vals = None
    if req.token_ids_logprob and res.ids_vals is not None:
        ids_vals = res.ids_vals[first:end, : len(req.token_ids_logprob)].tolist()
    if k:
        lp.input_ids.extend(req.origin_input_ids[a + 1 : a + 1 + k])
        lp.input_vals.extend(vals[:k])
        if tops is not None:
            lp.input_top_vals.extend(tops[0][:k])
            lp.input_top_ids.extend(tops[1][:k])
        if ids_vals is not None:
            lp.input_ids_vals.extend(ids_vals[:k])
    if sampled:
        lp.output_vals.append(vals[k])
        if tops is not None:
            lp.output_top_vals.append(tops[0][k])
            lp.output_top_ids.append(tops[1][k])
        if ids_vals is not None:
            lp.output_ids_vals.append(ids_vals[k])
