"""A step's results, on the host: each request's sampled token and logprobs
appended, finished requests ended (stop token, stop string, length, context),
prefilled requests moved to running, and the outbox turned into the
BatchTokenIDOutput the detokenizer gets; or a step's failure: its requests
ended with an abort reason (retracted once first on a CUDA OOM) and KV that was
never written dropped from the radix tree.

`process` and `fail_batch` work on the scheduler's state through the scheduler;
the other functions see one request (or the outbox's requests) alone. Nothing
here builds or launches batches, and nothing here decodes text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sgl.cache.radix_cache import RadixCache
from sgl.core.protocol import BatchTokenIDOutput, Logprobs
from sgl.sched.batch import ScheduleBatch
from sgl.sched.beam import apply_picks
from sgl.sched.decode import holders, retract
from sgl.sched.req import Req
from sgl.sched.runner.step import StepResult
from sgl.sched.stop import StopStrings

if TYPE_CHECKING:
    from sgl.sched.scheduler import Scheduler

MAX_ERROR_CHARS = 300  # of an exception's text in an abort message


def process(s: Scheduler, batch: ScheduleBatch, res: StepResult) -> None:
    """Apply one launched batch's results to its requests. A request whose results
    raise is aborted alone (logged with the traceback); the others go on."""
    for req in batch.unique_reqs:
        req.inflight -= 1  # first: whatever fails below, this batch holds none of them any more
    try:
        next_ids = res.next_ids.tolist()
    except Exception as e:  # noqa: BLE001 - the whole batch's results are unreadable
        fail_batch(s, batch, e, "result processing", kv_written=True)
        return
    row = -1  # the last logits row of the previous request
    for i, (req, epoch, partial, tok, (a, k)) in enumerate(zip(
            batch.reqs, batch.epochs, batch.partial, next_ids, batch.lp_in)):
        first, row = row + 1, row + 1 + (k if res.token is not None else 0)
        if req.finished or req.epoch != epoch:
            continue  # ended or retracted after this batch was launched: the token is stale
        try:
            if req.beam is not None:
                if i == 0 or batch.reqs[i - 1] is not req:  # a beam request's entries once
                    _apply_beams(s, batch, res, i, req, partial)
                continue
            _apply(s, batch, res, i, req, partial, tok, first, a, k)
        except Exception as e:  # contained to this request
            s.stats["failures"] += 1
            s.log.exception("processing a request's results failed: it is aborted", rid=req.rid)
            s.abort_now(req, error_message("result processing", e))


def sampled_tokens(batch: ScheduleBatch, res: StepResult) -> dict[Req, int]:
    """The token `process` is about to append to each grammar request of the batch, as
    it decides (see _apply): none for a request that ended or was retracted since the
    launch, one with an error or an abort pending, a middle prefill chunk, a prefill
    without output, or beams (their matchers take tokens at selection). Read before
    processing, so that grammar matchers take the tokens while they are processed."""
    out: dict[Req, int] = {}
    errors = res.errors or {}
    for i, (req, epoch, partial, tok) in enumerate(zip(batch.reqs, batch.epochs, batch.partial,
                                                       res.next_ids.tolist())):
        if req.grammar is not None and not (req.finished or req.epoch != epoch or partial or req.prefill_only
                                            or req.beam is not None or req.to_abort is not None or i in errors):
            out[req] = tok
    return out


def _apply(s: Scheduler, batch: ScheduleBatch, res: StepResult, i: int, req: Req, partial: bool, tok: int,
           first: int, a: int, k: int) -> None:
    """One request's share of a batch's results."""
    if res.errors and i in res.errors and req.to_abort is None:
        req.to_abort = res.errors[i]
    if req.to_abort is not None:
        if req.inflight == 0:
            s.finish(req, {"type": "abort", "message": req.to_abort})
        return
    if req.logprobs is not None and res.token is not None:
        add_logprobs(req, res, first, a, k, sampled=not partial and not req.prefill_only)
    if partial:
        return  # a middle prefill chunk samples nothing
    req.prompt_done = True
    if req.prefill_only:
        # Its prompt logprobs are in: the token sampled after the prompt is dropped.
        s.finish(req, {"type": "length", "length": 0})
        return
    req.output_ids.append(tok)
    reason = finish_reason(req, tok, s.eos_ids, s.stop_strings, s.runner.context_length)
    if req.grammar is not None and reason is None and tok in s.eos_ids:
        # The grammar is complete (its mask allows EOS only then), ignore_eos or not. The
        # matcher takes the token before the next mask, never here (sgl.sched.runner.grammar_masks).
        reason = {"type": "stop", "matched": tok}
    if not batch.is_decode:
        s.prefilling.discard(req)
        s.running.append(req)
        if reason is None:
            s.tree.cache_unfinished_req(req)  # its prompt is shareable while it decodes
    if reason is not None:
        s.finish(req, reason)
    elif req.stream:
        s.outbox.append(req)


def _apply_beams(s: Scheduler, batch: ScheduleBatch, res: StepResult, i: int, req: Req, partial: bool) -> None:
    """A beam request's share of a batch's results (its entries start at i)."""
    if res.errors and req.to_abort is None:
        bad = [e for j, e in sorted(res.errors.items()) if batch.reqs[j] is req]
        if bad:
            req.to_abort = bad[0]
    if req.to_abort is not None:
        if req.inflight == 0:
            s.finish(req, {"type": "abort", "message": req.to_abort})
        return
    if partial:
        return
    if not batch.is_decode:
        req.prompt_done = True
        s.prefilling.discard(req)
        s.running.append(req)
    assert res.beams is not None
    g, n = batch.beam_index[req]
    apply_picks(s, batch, i, req, res.beams[g], n)


def error_message(stage: str, e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    return f"internal error in {stage} ({type(e).__name__}): {text}"


def fail_batch(s: Scheduler, batch: ScheduleBatch, e: BaseException, stage: str, kv_written: bool) -> None:
    """A batch failed (`stage`: prepare, forward, result processing): each of its
    requests that this batch still speaks for ends with an abort reason and gives its
    KV back at once, later batches holding it in flight notwithstanding (their results
    are dropped, as after a retraction). On a CUDA OOM a request is retracted instead,
    once: it comes back through admission, recomputed. The caller has already taken
    the batch off its requests' `inflight`. `kv_written=False`: the forward may not
    have written the batch's KV, which the tree may share: it is dropped there."""
    if s.runner.tp.size > 1:
        # One rank's failure (an OOM on its GPU) is not the others': containing it would let
        # the ranks' states part and their collectives wait on each other. The rank ends
        # instead, and the engine's watchdog fails every request (and the server exits).
        raise RuntimeError(f"a batch failed on tensor-parallel rank {s.runner.tp.rank} ({stage}): this rank "
                           "stops, as the ranks can no longer agree") from e
    live = list(dict.fromkeys(r for r, ep in zip(batch.reqs, batch.epochs) if not r.finished and r.epoch == ep))
    oom = isinstance(e, torch.cuda.OutOfMemoryError)
    s.stats["failures"] += 1
    s.log.exception("a batch failed: its requests are " + ("retracted once" if oom else "aborted"), stage=stage,
                    decode=batch.is_decode, rids=[r.rid for r in live], exc_info=e)
    if oom and torch.cuda.is_available():
        torch.cuda.empty_cache()
    message = error_message(stage, e)
    for r in live:
        if r.finished:
            continue
        if oom and r not in s.oom_retried:
            s.oom_retried.add(r)
            retract(s, r)
        else:
            s.abort_now(r, message)
    if not kv_written:
        drop_unwritten(s, batch.out_cache_loc)


def drop_unwritten(s: Scheduler, slots: torch.Tensor) -> None:
    """Slots a failed batch was to write hold no valid KV, and the radix tree may
    already share some (a leader's prompt, a chunk cached while the next was being
    built). None may be read again: every KV holder whose prefix reaches them is
    retracted (recomputed later), and then the tree's unlocked part, theirs included,
    is evicted. A cost paid only after such a failure."""
    tree = s.tree
    slots = slots.reshape(-1).to("cpu", torch.int64)
    if tree.disable or not slots.numel() or not bool(torch.isin(tree_slots(tree), slots).any()):
        return
    for r in holders(s):
        if r.prefix_indices.numel() and bool(torch.isin(r.prefix_indices.cpu(), slots).any()):
            retract(s, r)
    tree.evict(tree.evictable_size())
    s.log.warning("dropped the radix cache's unlocked part: a failed batch's KV was in it")


def tree_slots(tree: RadixCache) -> torch.Tensor:
    """Every slot the tree holds (read only; for failure paths, not hot ones)."""
    values = [torch.empty(0, dtype=torch.int64)]
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            values.append(child.value.reshape(-1).to("cpu", torch.int64))
            stack.append(child)
    return torch.cat(values)


def start_logprobs(req: Req) -> None:
    """A new request's logprobs: with logprob_start_len=0 the first prompt token has
    none, which SGLang reports as None."""
    if req.logprob_start_len == 0 and req.logprobs is not None:
        lp = req.logprobs
        lp.input_ids.append(req.origin_input_ids[0])
        lp.input_vals.append(None)
        if req.top_logprobs_num:
            lp.input_top_vals.append(None)
            lp.input_top_ids.append(None)
        if req.token_ids_logprob:
            lp.input_ids_vals.append(None)


def add_logprobs(req: Req, res: StepResult, first: int, a: int, k: int, sampled: bool) -> None:
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


def finish_reason(req: Req, tok: int, eos_ids: set[int], stop_strings: StopStrings,
                  context_length: int) -> dict[str, Any] | None:
    """Why the request ends with `tok` (just appended to its outputs), or None."""
    p = req.sampling_params
    early = len(req.output_ids) <= p.min_new_tokens  # tok itself was masked if so
    if not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids)):
        return {"type": "stop", "matched": tok}
    if not early and p.stop_strs:
        s = stop_strings.match(req.output_ids, p.stop_strs, p.skip_special_tokens)
        if s is not None:
            return {"type": "stop", "matched": s}
    if len(req.output_ids) >= p.max_new_tokens:
        return {"type": "length", "length": p.max_new_tokens}
    if req.seq_len >= context_length:
        return {"type": "length", "length": len(req.output_ids)}
    return None


def token_id_output(reqs: list[Req]) -> BatchTokenIDOutput:
    """The outbox's requests as one message to the detokenizer: each one's ids and
    logprobs since its last message, which are marked sent."""
    out = BatchTokenIDOutput([], [], [], [], [], [], [], [], [], [], [], [], [])
    for r in reqs:
        out.rids.append(r.rid)
        out.new_ids.append(r.output_ids[r.sent_len :])
        r.sent_len = len(r.output_ids)
        out.finished_reasons.append(r.finished_reason)
        out.prompt_tokens.append(len(r.origin_input_ids))
        out.completion_tokens.append(len(r.output_ids))
        out.cached_tokens.append(r.cached_tokens)
        out.skip_special_tokens.append(r.sampling_params.skip_special_tokens)
        out.spaces_between_special_tokens.append(r.sampling_params.spaces_between_special_tokens)
        out.no_stop_trim.append(r.sampling_params.no_stop_trim)
        out.stop_strs.append(r.sampling_params.stop_strs)
        out.detokenize.append(r.detokenize)
        out.logprobs.append(r.logprobs)
        out.beams.append(r.beam.result if r.beam is not None else None)
        if r.logprobs is not None:
            r.logprobs = Logprobs()
    return out
