"""A new request's checks in the scheduler, before it is queued: the value limits
both sides apply (sgl.core.request_checks), a duplicate rid, a stream of beams, the
queue's bound (past it a request is refused with status_code 503), and what this
engine can run: its trie constraint (resolved here, kept by sgl.sched.trie_store),
its grammar, its LoRA adapter, and whether its steps must run serially.

It queues nothing and holds no request: the scheduler does that with its verdict."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from sgl.core import lora_rules as rules
from sgl.core.request_checks import RequestLimits, request_error
from sgl.sched.grammar import Grammars
from sgl.sched.lora import LoraManager
from sgl.sched.models.pooling import PooledPrompt
from sgl.sched.req import Req
from sgl.sched.runner.model_runner import ModelRunner
from sgl.sched.trie_store import TrieStore


class RequestIntake:
    def __init__(self, runner: ModelRunner, grammars: Grammars, has_tokenizer: bool,
                 allowed_processors: tuple[str, ...], max_top_logprobs_num: int,
                 max_queued_requests: int | None, lora: LoraManager | None = None) -> None:
        self.runner = runner
        self.lora = lora
        self.grammars = grammars
        self.tries = TrieStore()
        self._arrivals = itertools.count()
        self.max_queued_requests = max_queued_requests
        r = runner
        self.limits = RequestLimits(r.vocab_size, r.context_length, r.max_total_tokens, has_tokenizer,
                                    allowed_processors, max_top_logprobs_num,
                                    max_running_requests=r.max_running_requests)

    def check(self, req: Req, live: Mapping[str, Req], queued: int, busy: bool = False) -> dict[str, Any] | None:
        """The abort reason a new request ends with at once, or None: then it is accepted,
        its trie, `serial` and place in arrival order set. `busy`: refused as by a full
        queue (a planted fault). A request this engine cannot run as asked carries
        status_code 400 (the caller's ValueError, an HTTP 400); one refused for a full
        queue, 503."""
        error = self._error(req, live)
        if error is not None:
            return {"type": "abort", "status_code": 400, "message": error}
        if req.lora_name is not None:  # an adapter unloaded since the caller's side checked the name: a 400
            error = rules.disabled("lora_path") if self.lora is None else self.lora.resolve(req)
            if error is not None:
                return {"type": "abort", "status_code": 400, "message": error}
        bound = self.max_queued_requests
        if busy or (bound is not None and queued >= bound):
            # Refused at once, not queued: the HTTP layer maps status_code to 503.
            return {"type": "abort", "status_code": 503,
                    "message": f"server busy: {queued} queued requests (max_queued_requests={bound}); retry later"}
        error = self._constrain(req) or self.grammars.error(req)
        if error is not None:
            return {"type": "abort", "status_code": 400, "message": error}
        req.arrival = next(self._arrivals)
        return None

    def _error(self, req: Req, live: Mapping[str, Req]) -> str | None:
        if req.rid in live:
            return f"rid: duplicate request id {req.rid!r}: a request with this rid is still running"
        if req.beam is not None and req.stream:
            return "stream: a beam search request cannot stream (its beams are known only at the end)"
        if req.embed and (error := self._embedding_error(req)) is not None:
            return error

        return request_error(req.origin_input_ids, req.sampling_params, req.logprob_start_len, req.top_logprobs_num,
                             req.token_ids_logprob, req.processor, self.limits, return_logprob=req.return_logprob,
                             priority=req.priority, timeout=req.timeout)

    def _embedding_error(self, req: Req) -> str | None:
        """Why an embedding request cannot run, or None: then its pool is set."""
        pooling = self.runner.pooling
        if pooling is None:
            return ("model: this model serves no embeddings (no sentence-transformers Pooling module): start the "
                    "engine with is_embedding (--is-embedding)")
        if req.sampling_params.max_new_tokens != 0 or req.return_logprob or req.beam is not None:
            return "embed: an embedding request takes max_new_tokens=0, no logprobs and no beams"
        req.pooled = PooledPrompt(pooling.mode, pooling.normalize)
        return None

    def _constrain(self, req: Req) -> str | None:
        """Set the request's trie and whether it runs serially; why it cannot run, or None."""
        r = self.runner
        proc = r.processors.get(req.processor) if req.processor else None
        # The host must know each step's outcome before the next: processors reading output ids,
        # beams under a grammar (which beam forks which matcher is known only from the
        # selection), and beams on CPU, whose forward worker would move rows while the next
        # batch is prepared. Plain grammar requests keep the overlap: their masks are filled
        # once the previous step's tokens are known (sgl.sched.runner.step.Step).
        beam_serial = req.beam is not None and (req.sampling_params.grammar is not None or r.device.type == "cpu")
        req.serial = (proc is not None and proc.needs_output_ids) or beam_serial
        c = req.sampling_params.constraint
        if c is None:
            return None
        try:
            req.trie = self.tries.get(c, r.vocab_size)
        except ValueError as e:
            return str(e)
        return None
