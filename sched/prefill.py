"""The waiting queue and prefill admission.

PrefillManager owns the requests on their way to decoding: the waiting queue, the
chunked request (admitted, with prompt left for later rounds) and the prefilling set
(admitted, last prefill chunk not processed yet). Each turn, `schedule` runs one
admission round and builds its batch.

A PrefillAdder holds one round's limits: the token budget (max_prefill_tokens),
the chunk room left, the prompt-logprob rows left (each prompt token of a request
asking for prompt logprobs is a [vocab] float32 row in the forward, bounded apart
from the chunk: PROMPT_LOGPROB_BYTES), the request slots, and the KV room once the running
requests' future tokens are reserved (new_token_ratio of their remaining
max_new_tokens, each clipped at CLIP_MAX_NEW_TOKENS). For each request it matches
the prompt in the radix tree, locks the match, and either admits the request (it
takes a req_to_token row, writes its cached prefix there and keeps the lock) or
unlocks the match again.

With LoRA adapters each admitted request takes its adapter's device slot
(sgl.sched.lora); one whose adapter finds every slot busy is deferred, and
the round goes on with the others.

A blocked chunk ends the round with nothing admitted: the scheduler's liveness
argument (sgl.sched.decode) rests on it, as the most senior KV holder's chunk must not
wait behind requests admitted after it.

Under the priority policy a waiting request that lacks KV or a request slot may
preempt: running requests of strictly lower priority are retracted, least senior
first, as many as make it fit, and none when all of them would not. Only strictly
lower priorities give way, so two requests never preempt each other, and the one
admitted outranks every victim: the liveness argument in sgl.sched.decode holds.

A PrefillAdder never allocates KV slots, builds a batch, or reorders or edits the
waiting queue: its manager does that with `admitted` and `chunked_req`, and a
preemption's victims are requeued by the DecodeManager."""

from __future__ import annotations

import bisect
import enum
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Protocol

from sgl.cache.radix_cache import MatchResult
from sgl.sched.batch import ScheduleBatch
from sgl.sched.kv_cache import KVCache
from sgl.sched.lora import LoraManager
from sgl.sched.policy import order_waiting, queue_key
from sgl.sched.req import Req

CLIP_MAX_NEW_TOKENS = 4096
# The float32 prompt-logprob rows one prefill forward may hold (their log_softmax),
# whatever the chunk: 2 GiB is 3,533 rows of Qwen3's 151,936-token vocabulary, so an
# H200's 16,384-token chunk does not become 10 GB of logprobs.
PROMPT_LOGPROB_BYTES = 2 << 30
IN_BATCH_PREFIX_MIN = 32  # shared tokens beyond the tree's match that make a request wait for a sibling


class Verdict(enum.Enum):
    """What became of one waiting request."""

    ADMITTED = "admitted"  # the rest of its prompt is in the batch; the next request may follow
    CHUNKED = "chunked"  # its first chunk is in: it is the chunked request now, and the round is over
    DEFERRED = "deferred"  # it waits a round (for its leader's prompt, or a prefix in flight); the next may follow
    FULL = "full"  # the budget, the chunk, the request slots or the rows are used up: the round is over
    NO_ROOM = "no_room"  # its tokens (with their reserve) do not fit in the KV left: the round is over

    @property
    def goes_on(self) -> bool:
        """Whether the next waiting request may still be considered this round."""
        return self in (Verdict.ADMITTED, Verdict.DEFERRED)


class Preemption(Protocol):
    """Who retracts running requests for a more urgent waiting one (the DecodeManager)."""

    def victims(self, req: Req) -> list[Req]:
        """The running requests `req` may preempt, the first to go first."""
        ...

    def preempt(self, victims: list[Req]) -> None:
        """Retract them (their KV given back, requeued)."""
        ...


def future_tokens(req: Req) -> int:
    """The tokens a request may still generate, clipped (every beam's, for a beam request)."""
    beams = req.beam.width if req.beam is not None else 1
    return min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS) * beams


def prompt_logprob_rows(vocab_size: int, chunk_size: int) -> int:
    """Prompt tokens with logprobs one round may compute (at least one, at most a chunk)."""
    return max(1, min(chunk_size, PROMPT_LOGPROB_BYTES // (4 * vocab_size)))


def reserved_tokens(running: Iterable[Req], new_token_ratio: float) -> int:
    """KV the running requests are expected to still need."""
    return sum(int(future_tokens(r) * new_token_ratio) for r in running)


class PrefillAdder:
    def __init__(
        self,
        kv: KVCache,
        *,
        running: Collection[Req],
        prefilling: Collection[Req],
        rids: Mapping[str, Req],
        max_prefill_tokens: int,
        chunk_size: int,
        logprob_rows: int,
        max_running_requests: int,
        new_token_ratio: float,
        preemption: Preemption | None = None,
        lora: LoraManager | None = None,
    ) -> None:
        self.kv = kv
        self.lora = lora
        # The adapter slots of the requests holding KV (admitted ones join as they are).
        self.lora_busy = lora.busy((*running, *prefilling)) if lora is not None else set()
        self.running = running
        self.preemption = preemption  # the priority policy's: running requests may give way
        self.preempted = False  # this round retracted running requests for a waiting one
        self.tree = kv.tree
        self.prefilling = prefilling  # admitted in earlier rounds, last prefill chunk not processed yet
        self.rids = rids  # live requests by rid (an n > 1 sibling's leader)
        self.n_running = len(running)
        self.max_running_requests = max_running_requests
        self.new_token_ratio = new_token_ratio
        self.budget = max_prefill_tokens  # prefill tokens left this round
        self.chunk_left = chunk_size  # tokens left in this round's chunk
        self.logprob_rows_left = logprob_rows  # prompt tokens with logprobs left this round
        self.reserved = reserved_tokens(running, new_token_ratio)
        self.claimed = 0  # tokens admitted this round (allocated by the scheduler) plus their reserve
        self.admitted: list[Req] = []
        self.chunked_req: Req | None = None  # the admitted request with prompt left after this round
        self.cached_tokens = 0  # prefix tokens the admitted requests found in the tree
        self.current: Req | None = None  # the request being considered (a failure names it)

    # ---- room ------------------------------------------------------------------

    def available(self) -> int:
        """KV slots free or evictable now."""
        return self.kv.available()

    def room(self) -> int:
        """KV left for this round's requests. Live: locking a matched prefix takes it
        out of the evictable pool."""
        return self.available() - self.reserved - self.claimed

    # ---- admission -------------------------------------------------------------

    def add_chunked(self, req: Req) -> bool:
        """The chunked request's next chunk, first in the round. False: the round admits
        nothing (the request is being aborted, or its chunk does not fit)."""
        self.current = req
        if req.to_abort is not None:
            return False  # finished by the scheduler once its last chunk is processed
        # Hand the chunks written so far to the tree (their KV may still be in flight:
        # the worker runs batches in order, so later readers see it written).
        self.tree.cache_unfinished_req(req)
        n = self._chunk(req, req.seq_len - req.kv_len)
        if n > self.room():
            return False
        req.extend_len = n
        self.admitted.append(req)
        self._take_rows(req, n)
        self.chunk_left -= n
        self.budget -= n
        self.claimed += n
        self.chunked_req = None if req.kv_len + n == req.seq_len else req
        return True

    def add_waiting(self, waiting: list[Req], policy: str) -> None:
        """The waiting requests in the policy's order, until one ends the round; none
        while the chunked request still has prompt left (its chunk is the round's)."""
        if self.chunked_req is not None:
            return
        for req in order_waiting(waiting, policy, self.tree):
            # After a preemption the round ends: its victims wait behind nothing of lower priority.
            if not self.add_one(req).goes_on or self.preempted:
                break

    def add_one(self, req: Req) -> Verdict:
        """Consider one waiting request (the caller stops at a verdict that does not go on)."""
        self.current = req
        slot_short = not self._slots_free(req)
        if self.chunk_left <= 0 or self.budget <= 0 or (slot_short and self.preemption is None):
            return Verdict.FULL
        if req.needs_input_logprobs and self.logprob_rows_left <= 0:
            return Verdict.FULL
        if req.prefix_leader is not None and (lead := self.rids.get(req.prefix_leader)) and lead.is_leader:
            return Verdict.DEFERRED  # waits for its leader's prompt to be in the tree
        ids = req.all_ids
        limit = req.prefix_limit
        match = self.tree.match_prefix(ids[:limit], req.cache_namespace)
        # Only a request that may take its whole prefix from the tree waits for one in flight.
        if limit == len(ids) - 1 and self.prefix_in_flight(ids, len(match.indices), req.cache_namespace):
            return Verdict.DEFERRED  # its prefix is being computed: wait a round and reuse it
        todo = len(ids) - len(match.indices)
        n = self._chunk(req, todo)
        need = n + (int(future_tokens(req) * self.new_token_ratio) if n == todo else 0)
        # Lock the match first: a locked prefix is no longer evictable room.
        self.tree.inc_lock_ref(match.last_node)
        if (slot_short or not self._fits(need, n)) and not self._preempt_for(req, need, n, slot_short):
            # It waits until running requests finish or retract; alone, it goes
            # without a reserve as soon as its own tokens fit.
            self.tree.dec_lock_ref(match.last_node)
            return Verdict.FULL if slot_short else Verdict.NO_ROOM
        if self.lora is not None and not self.lora.slot_for(req, self.lora_busy):
            self.tree.dec_lock_ref(match.last_node)
            return Verdict.DEFERRED  # every adapter slot is busy with other adapters
        self._admit(req, match, n)
        self.admitted.append(req)
        self._take_rows(req, n)
        self.claimed += need
        self.budget -= n
        self.chunk_left -= n
        if n < todo:
            self.chunked_req = req
            return Verdict.CHUNKED
        return Verdict.ADMITTED

    def _slots_free(self, req: Req, gone: int = 0) -> bool:
        """Whether a request slot and its rows (a row per beam) are free, were `gone`
        running requests (no beams) retracted."""
        rows = req.beam.width if req.beam is not None else 1
        return (self.n_running - gone + len(self.admitted) < self.max_running_requests
                and self.kv.pool.available_size() + gone >= rows)

    def _fits(self, need: int, n: int, freed: int = 0, reserve: int = 0, gone: int = 0) -> bool:
        """Whether `n` tokens to compute (`need` with their reserve) fit, were `freed` KV
        slots given back by `gone` running requests whose reserve was `reserve`."""
        alone = not self.admitted and self.n_running == gone
        return (alone or need <= self.room() + freed + reserve) and n <= self.available() - self.claimed + freed

    def _preempt_for(self, req: Req, need: int, n: int, slot_short: bool) -> bool:
        """Under the priority policy, make room for `req` (its match locked): retract the
        least senior running requests of lower priority until it fits (a request slot
        too if `slot_short`), none unless it then does. Whether it fits now."""
        if self.preemption is None:
            return False
        victims: list[Req] = []
        reserve = 0
        for v in self.preemption.victims(req):
            victims.append(v)
            reserve += int(future_tokens(v) * self.new_token_ratio)
            slots_ok = not slot_short or self._slots_free(req, len(victims))
            if slots_ok and self._fits(need, n, self.kv.freed_by(victims), reserve, len(victims)):
                break
        else:
            return False
        self.preemption.preempt(victims)
        if self.lora is not None:  # the victims' slots are free now
            self.lora_busy = self.lora.busy((*self.running, *self.prefilling, *self.admitted))
        self.preempted = True
        self.n_running -= len(victims)
        self.reserved -= reserve
        return self._slots_free(req) and self._fits(need, n)

    def _chunk(self, req: Req, todo: int) -> int:
        """How much of a request's `todo` prompt tokens this round takes."""
        n = min(todo, self.chunk_left)
        return min(n, self.logprob_rows_left) if req.needs_input_logprobs else n

    def _take_rows(self, req: Req, n: int) -> None:
        if req.needs_input_logprobs:
            self.logprob_rows_left -= n

    def prefix_in_flight(self, ids: list[int], matched: int, namespace: int = 0) -> bool:
        """Whether a request being prefilled (this round or in flight) shares a longer
        prefix with `ids` than the radix tree holds now: then waiting for it to be
        cached beats computing the same prefix twice (in-batch prefix caching)."""
        if self.tree.disable:
            return False
        limit = len(ids) - 1
        for other in (*self.prefilling, *self.admitted):
            if other.cache_namespace != namespace:
                continue
            o = other.origin_input_ids
            n = min(limit, len(o))
            if n - matched < IN_BATCH_PREFIX_MIN or ids[matched] != o[matched]:
                continue
            if ids[matched : matched + IN_BATCH_PREFIX_MIN] == o[matched : matched + IN_BATCH_PREFIX_MIN]:
                return True
        return False

    def _admit(self, req: Req, match: MatchResult, n: int) -> None:
        """Give the request a row holding its cached prefix (locked by the caller) and
        its first `n` tokens to compute."""
        self.kv.take_rows(req, match)
        prefix = len(match.indices)
        self.cached_tokens += prefix
        if req.retractions == 0:
            req.cached_tokens = max(req.cached_tokens, prefix)
        req.extend_len = n


class PrefillManager:
    """The waiting queue, the chunked request and the prefilling set, and one
    admission round a turn."""

    def __init__(self, kv: KVCache, *, policy: str, max_prefill_tokens: int, chunk_size: int, vocab_size: int,
                 max_running_requests: int, lora: LoraManager | None = None) -> None:
        self.kv = kv
        self.lora = lora
        self.policy = policy
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.logprob_rows = prompt_logprob_rows(vocab_size, chunk_size)
        self.max_running_requests = max_running_requests
        self.waiting: list[Req] = []
        self.chunked: Req | None = None
        self.prefilling: set[Req] = set()  # admitted, last prefill chunk not processed yet (the chunked one too)
        self.round: PrefillAdder | None = None  # the round being built (a failure aborts its requests)
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0}

    @property
    def busy(self) -> bool:
        """Whether a request waits or has prompt left to prefill."""
        return bool(self.waiting) or self.chunked is not None

    def add(self, req: Req) -> None:
        """A new request joins the queue: last (under the priority policy, last of its priority)."""
        if self.policy == "priority":
            self.waiting.insert(bisect.bisect_right(self.waiting, queue_key(req), key=queue_key), req)
        else:
            self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request: first in the queue (first of its priority), its KV given back already."""
        self.remove(req)
        at = bisect.bisect_left(self.waiting, queue_key(req), key=queue_key) if self.policy == "priority" else 0
        self.waiting.insert(at, req)

    def remove(self, req: Req) -> None:
        """Take an admitted request out of the chunk and the prefilling set."""
        self.prefilling.discard(req)
        if req is self.chunked:
            self.chunked = None

    def unqueue(self, req: Req) -> bool:
        """Take a request out of the queue (a scan: for aborts and failures); whether it was there."""
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        return False

    def share_prompt(self, lead: Req) -> None:
        """n > 1: make the leader's prompt KV reachable through the radix tree for its
        siblings, now if its prompt is already built into a batch, else once it is."""
        if lead.finished or lead.to_abort is not None:
            return
        if lead.req_pool_idx is not None and lead is not self.chunked and lead.kv_len >= len(lead.origin_input_ids):
            self.kv.cache_unfinished(lead)
        else:
            lead.is_leader = True

    def building(self) -> list[Req]:
        """The requests the round being built has taken in (a failure aborts them)."""
        a = self.round
        return [*a.admitted, *([a.current] if a.current else [])] if a is not None else []

    def schedule(self, running: Collection[Req], rids: Mapping[str, Req], new_token_ratio: float,
                 admit: bool = True, preemption: Preemption | None = None,
                 decode_rows: int = 0) -> ScheduleBatch | None:
        """The round: the chunked request's next chunk and (if `admit`) the waiting requests
        that fit, admitted, given their KV slots and built into a batch; None when nothing is.
        Under the priority policy `preemption` may retract running requests for them.
        `decode_rows`: tokens of a decode step that may share the forward (a mixed batch),
        taken from the chunk, though never more than half of it."""
        self.round = None
        if self.chunked is None and not (admit and self.waiting):
            return None
        chunk = self.chunk_size - min(decode_rows, self.chunk_size // 2)
        adder = self.round = PrefillAdder(
            self.kv, running=running, prefilling=self.prefilling, rids=rids,
            max_prefill_tokens=self.max_prefill_tokens, chunk_size=chunk, logprob_rows=self.logprob_rows,
            max_running_requests=self.max_running_requests, new_token_ratio=new_token_ratio,
            preemption=preemption if self.policy == "priority" else None, lora=self.lora)
        if self.chunked is not None and not adder.add_chunked(self.chunked):
            return None
        if admit:
            adder.add_waiting(self.waiting, self.policy)
        admitted = adder.admitted
        for req in admitted:
            if req in self.waiting:
                self.waiting.remove(req)
        self.chunked = adder.chunked_req
        if not admitted:
            return None
        self.stats["cached_tokens"] += adder.cached_tokens
        self.prefilling.update(admitted)
        total = sum(r.extend_len for r in admitted)
        loc = self.kv.alloc(total)
        if loc is None:  # cannot happen: admission kept within available + evictable
            raise RuntimeError(f"KV allocation of {total} failed after admission: {self.kv.info()}, reqs {admitted}")
        self.stats["prefill_tokens"] += total
        batch = ScheduleBatch.extend(admitted, loc, self.kv.pool)
        for req in admitted:
            if req.is_leader and req.kv_len >= len(req.origin_input_ids):
                req.is_leader = False
                self.kv.cache_unfinished(req)
        return batch

    def info(self) -> dict[str, Any]:
        return {"waiting": len(self.waiting), "chunked_prefill_size": self.chunk_size, **self.stats}
