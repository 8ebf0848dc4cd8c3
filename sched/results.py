"""A step's results, on the host: each request's sampled token and logprobs
appended, finished requests ended (stop token, stop string, length, context),
prefilled requests moved to running, and the outbox turned into the
BatchTokenIDOutput the detokenizer gets.

`process` works on the scheduler's state through the scheduler; the other
functions see one request (or the outbox's requests) alone. Nothing here builds
or launches batches, and nothing here decodes text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.core.protocol import BatchTokenIDOutput, Logprobs
from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req
from sgl.sched.runner.step import StepResult
from sgl.sched.stop import StopStrings

if TYPE_CHECKING:
    from sgl.sched.scheduler import Scheduler


def process(s: Scheduler, batch: ScheduleBatch, res: StepResult) -> None:
    """Apply one launched batch's results to its requests."""
    row = -1  # the last logits row of the previous request
    for i, (req, epoch, partial, tok, (a, k)) in enumerate(zip(
            batch.reqs, batch.epochs, batch.partial, res.next_ids.tolist(), batch.lp_in)):
        req.inflight -= 1
        first, row = row + 1, row + 1 + (k if res.token is not None else 0)
        if req.finished or req.epoch != epoch:
            continue  # ended or retracted after this batch was launched: the token is stale
        if res.errors and i in res.errors and req.to_abort is None:
            req.to_abort = res.errors[i]
        if req.to_abort is not None:
            if req.inflight == 0:
                s.finish(req, {"type": "abort", "message": req.to_abort})
            continue
        if req.logprobs is not None and res.token is not None:
            add_logprobs(req, res, first, a, k, sampled=not partial and not req.prefill_only)
        if partial:
            continue  # a middle prefill chunk samples nothing
        req.prompt_done = True
        if req.prefill_only:
            # Its prompt logprobs are in: the token sampled after the prompt is dropped.
            s.finish(req, {"type": "length", "length": 0})
            continue
        req.output_ids.append(tok)
        reason = finish_reason(req, tok, s.eos_ids, s.stop_strings, s.runner.context_length)
        if not batch.is_decode:
            s.prefilling.discard(req)
            s.running.append(req)
            if reason is None:
                s.tree.cache_unfinished_req(req)  # its prompt is shareable while it decodes
        if reason is not None:
            s.finish(req, reason)
        elif req.stream:
            s.outbox.append(req)


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
    out = BatchTokenIDOutput([], [], [], [], [], [], [], [], [], [], [], [])
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
        if r.logprobs is not None:
            r.logprobs = Logprobs()
    return out
