"""The scripted scheduler of a `FakeEngine` (sgl/testing/fake.py), the one role a fake
engine does not run for real. It answers each GenerateReqInput with the
BatchTokenIDOutput messages the scheduler would send, built from a responder's output:
its text or token ids, or for a grammar request that text if it matches, else a text
written from the grammar (`grammar_text`, sgl/testing/fake_grammar.py); ended by the scheduler's rules (`FinishRule`);
sent one token per step on the loop's clock, shaped as the scheduler's Outbox shapes
them, with stand-in logprobs of the real shapes and cached_tokens from a prefix memory
(one per LoRA adapter); under the faults of a FaultPlan. A request's LoRA adapter must be
loaded, and changes nothing of its output. It answers control calls as the scheduler does, the
control plane's included (`FakeControlPlane`, sgl/testing/fake_control.py: pausing, aborting every request, weight
updates and the weight version, releasing memory, loading and unloading adapters), by the real one's rules.

It never decodes output text (the real detokenizer downstream does) and never sees
the caller: messages come in through its inbox and leave through its sender."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sgl.core.faults import Abort, Busy, ControlCall, Die, Effect, Fail, FaultPlan, Hang, SlowFirstToken, control_misuse
from sgl.core.protocol import (
    CONTROL_PLANE,
    AbortReq,
    BatchTokenIDOutput,
    Beam,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    Logprobs,
    Message,
    SetFaultsReq,
    SetFaultsReqOutput,
)
from sgl.core.sampling_params import SamplingParams, TrieConstraint
from sgl.core.server_args import ServerArgs
from sgl.sched.stop import StopStrings
from sgl.testing.fake_control import FakeControlPlane
from sgl.testing.fake_grammar import Refused, grammar_text
from sgl.transports.channel import Sender

Output = str | list[int]  # a text, or the output's token ids as they are
Answer = Callable[[str, SamplingParams], Output]  # (prompt, sampling params) -> the output
MAX_NAMED_TRIES = 64  # as the scheduler keeps named tries (sgl.sched.trie_store)


# ---- what a request's output is --------------------------------------------------------


class FinishRule:
    """The scheduler's rules for where an output ends (ResultProcessor._finish_reason
    and the sampler's min_new_tokens ban, sgl/sched), applied to a scripted output.
    Stop strings are matched by the scheduler's own StopStrings."""

    def __init__(self, eos_ids: list[int], context_length: int, stops: StopStrings | None, filler: int) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.eos = sorted(eos_ids)[:1]
        self.context_length = context_length
        self.stops = stops
        self.filler = filler  # a token for an output that may not end yet and whose script only ends

    def play(self, script: list[int], p: SamplingParams, prompt_len: int,
             grammar: bool) -> tuple[list[int], FinishReason]:
        """The output a model that says `script`, then EOS, over and over, gives under `p`."""
        said = [*script, *self.eos] or [self.filler]
        model, out = itertools.cycle(said), list[int]()
        while True:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids) \
                if len(out) < p.min_new_tokens else set()
            tok = next((t for t in itertools.islice(model, len(said)) if t not in banned), self.filler)
            out.append(tok)
            reason = self.reason(out, tok, p, prompt_len, grammar)
            if reason is not None:
                return out, reason

    def reason(self, out: list[int], tok: int, p: SamplingParams, prompt_len: int,
               grammar: bool) -> FinishReason | None:
        early = len(out) <= p.min_new_tokens
        if not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids)):
            return {"type": "stop", "matched": tok}
        if not early and (p.stop_strs or p.stop_regex) and self.stops is not None:
            s = self.stops.match(out, p.stop_strs, p.skip_special_tokens, p.stop_regexes)
            if s is not None:
                return {"type": "stop", "matched": s}
        if min(p.max_new_tokens - len(out), self.context_length - prompt_len - len(out)) <= 0:
            return {"type": "length", "length": p.max_new_tokens if len(out) >= p.max_new_tokens else len(out)}
        if grammar and tok in self.eos_ids:
            return {"type": "stop", "matched": tok}
        return None


class TokenizerStops(StopStrings):
    """The scheduler's stop-string matcher over a tokenizer already loaded."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(None, False)
        self._tokenizer = tokenizer

    def tokenizer(self) -> Any:
        return self._tokenizer


# ---- the scheduler ---------------------------------------------------------------------


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> None:
    """`fn()` on `loop`: now if this thread runs it, else soon; never on a closed loop."""
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        fn()
    elif not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # it closed meanwhile
            loop.call_soon_threadsafe(fn)


class Inbox(Protocol):
    """Where the scheduler's messages wait (sgl.testing.fake.LoopPipe)."""

    closed: bool

    def recv_all_nowait(self) -> list[Message]: ...

    async def wait(self, timeout: float | None) -> None: ...


@dataclass(frozen=True, slots=True)
class Latency:
    """Loop-time seconds from a request's arrival to its first token, and between tokens."""

    first_token_s: float = 0.0
    per_token_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the scheduler knows of its model (its server info reports them)."""

    vocab_size: int
    context_length: int
    eos_ids: list[int]
    max_total_tokens: int
    max_running_requests: int


class PrefixMemory:
    """The radix cache as far as cached_tokens tells it: the token sequences cached
    since the last flush, as a trie of ids per LoRA adapter (None: the base model), since
    KV that one adapter made is never another's prefix."""

    def __init__(self) -> None:
        self.roots: dict[str | None, dict[int, Any]] = {}
        self.sizes: dict[str | None, int] = {}  # tokens held, per adapter

    @property
    def size(self) -> int:
        return sum(self.sizes.values())

    def match(self, ids: list[int], adapter: str | None = None) -> int:
        node, n = self.roots.get(adapter, {}), 0
        while n < len(ids) and ids[n] in node:
            node, n = node[ids[n]], n + 1
        return n

    def insert(self, ids: list[int], adapter: str | None = None) -> None:
        node = self.roots.setdefault(adapter, {})
        for t in ids:
            if t not in node:
                node[t] = {}
                self.sizes[adapter] = self.sizes.get(adapter, 0) + 1
            node = node[t]

    def drop(self, adapter: str) -> None:
        """An unloaded adapter's prefixes: no request can match them again."""
        self.roots.pop(adapter, None)
        self.sizes.pop(adapter, None)

    def flush(self) -> None:
        self.roots, self.sizes = {}, {}


def token_logprob(tok: int, position: int) -> float:
    """The stand-in log-probability of `tok` at `position`: deterministic, in (-3.1, 0)."""
    return -((tok * 31 + position * 17) % 97 + 1) / 32.0


@dataclass(eq=False)
class _Run:
    """One request in the scripted scheduler: its planned output and how far it got."""

    msg: GenerateReqInput
    arrival: int = 0
    effects: list[Effect] = field(default_factory=list)
    planned: list[int] = field(default_factory=list)
    planned_finish: FinishReason = field(default_factory=dict)
    beams: list[Beam] | None = None  # a beam request's, best first
    output_ids: list[int] = field(default_factory=list)
    sent: int = 0
    cached: int = 0
    admitted: bool = False
    due: float | None = None  # loop time of its next token; None: hung
    logprobs: Logprobs | None = None
    finished: FinishReason | None = None

    @property
    def logprob_start(self) -> int:
        return self.msg.logprob_start_len if self.msg.return_logprob else -1


class ScriptedScheduler:
    """The scheduler role of a fake engine, an asyncio task on the caller's loop."""

    def __init__(self, args: ServerArgs, tokenizer: Any, model: ModelFacts, responses: Answer,
                 faults: FaultPlan, latency: Latency, inbox: Inbox, send: Sender,
                 on_death: Callable[[str], None]) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.model = model
        self.responses = responses
        self.faults = faults
        self.latency = latency
        self.inbox = inbox
        self.send = send
        self.on_death = on_death
        self.rule = FinishRule(model.eos_ids, model.context_length, TokenizerStops(tokenizer),
                               tokenizer.encode(" ", add_special_tokens=False)[-1])
        self.memory = PrefixMemory()
        self.live: dict[str, _Run] = {}
        self.waiting: deque[_Run] = deque()
        self.running: list[_Run] = []
        self.outbox: dict[_Run, None] = {}
        self.tries: dict[str, list[list[int]]] = {}
        self.failures = 0
        self.arrivals = itertools.count()
        self.control = FakeControlPlane(self)
        self.dead = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run on the running loop (the tokenizer manager's) from its first message on."""
        if self._task is None and not self.dead:
            self.loop = asyncio.get_running_loop()
            self._task = self.loop.create_task(self.run())

    def stop(self) -> None:
        """End the task, from any thread."""
        if self._task is not None and self.loop is not None:
            call_on_loop(self.loop, self._task.cancel)

    async def run(self) -> None:
        assert self.loop is not None
        while not self.dead and not self.inbox.closed:
            for msg in self.inbox.recv_all_nowait():
                self.handle(msg)
            self._admit()
            now = self.loop.time()
            for r in [r for r in self.running if r.due is not None and r.due <= now]:
                if not self.dead and not self.control.frozen:
                    self._step(r, now)
            self.flush()
            for reply in self.control.step() if not self.dead else ():  # updates that waited for the running
                self.send.send(reply)
            self._admit()  # into the room the finished ones left
            dues = [r.due for r in self.running if r.due is not None and not self.control.frozen]
            if dues and min(dues) <= now:
                await asyncio.sleep(0)
            else:
                await self.inbox.wait(min(dues) - now if dues else None)

    # ---- input -------------------------------------------------------------------------

    def handle(self, msg: Message) -> None:
        if self.dead:
            return
        if isinstance(msg, GenerateReqInput):
            self._arrive(msg)
        elif isinstance(msg, AbortReq):
            if (r := self.live.get(msg.rid)) is not None:
                self._finish(r, {"type": "abort", "message": "aborted by the client"})
        elif isinstance(msg, (FlushCacheReq, GetServerInfoReq, HealthCheckReq)):
            self._control(msg)
        elif isinstance(msg, CONTROL_PLANE):
            if (reply := self.control.handle(msg)) is not None:
                reply.origin, reply.req_id = msg.origin, msg.req_id
                self.flush()  # a reply follows the outputs it caused
                self.send.send(reply)
        elif isinstance(msg, SetFaultsReq):  # as the scheduler installs a plan sent as data
            why = next(filter(None, (control_misuse(f.effect, f.when) for f in msg.faults or ())), None)
            if why is None:
                self.faults = FaultPlan.from_specs(msg.faults) if msg.faults is not None else FaultPlan()
            self.send.send(SetFaultsReqOutput(why is None, why or "", msg.origin, msg.req_id))

    def _arrive(self, msg: GenerateReqInput) -> None:  # the checks of sgl.sched.intake, then its plan
        p, ids = msg.sampling_params, msg.input_ids
        r = _Run(msg, next(self.arrivals), self.faults.for_request(msg.rid, ids, self._prompt(ids), p, msg.stream))
        r.logprobs = Logprobs() if msg.return_logprob else None  # a refused request sends its empty lists
        bound = self.args.max_queued_requests
        try:
            if (refused := self.control.refusal()) is not None:
                raise Refused(refused)
            if (unknown := self.control.adapters.refusal(msg.lora_path)) is not None:
                raise Refused({"type": "abort", "status_code": 400, "message": unknown})
            if msg.rid in self.live:
                raise Refused({"type": "abort", "status_code": 400, "message": f"rid: duplicate request id "
                               f"{msg.rid!r}: a request with this rid is still running"})
            if any(isinstance(e, Busy) for e in r.effects) or (bound is not None and len(self.waiting) >= bound):
                raise Refused({"type": "abort", "status_code": 503, "message": f"server busy: {len(self.waiting)} "
                               f"queued requests (max_queued_requests={bound}); retry later"})
            self._plan(r)
        except Refused as e:
            return self._end(r, e.reason)
        if r.logprob_start == 0:  # the first prompt token has no logprob: None, as SGLang reports it
            self._add_logprob(r, ids[0], None, into="input")
        if p.max_new_tokens == 0 and r.logprob_start < 0:
            return self._end(r, {"type": "length", "length": 0})  # nothing to compute
        self.live[msg.rid] = r
        self.waiting.append(r)

    def _plan(self, r: _Run) -> None:
        """The request's whole output, decided as it arrives (the responder is asked now)."""
        p, ids = r.msg.sampling_params, r.msg.input_ids
        if p.max_new_tokens == 0:
            r.planned_finish = {"type": "length", "length": 0}
            return
        if not p.beam_width:
            r.planned, r.planned_finish = self.rule.play(self._script(ids, p), p, len(ids), p.grammar is not None)
            return
        beams = []
        for _ in range(p.beam_width):  # the responder is asked once per beam
            out, fin = self.rule.play(self._script(ids, p), p, len(ids), p.grammar is not None)
            cum = sum(token_logprob(t, len(ids) + j) for j, t in enumerate(out))
            beams.append(Beam(out, cum, cum / len(out) ** p.length_penalty, fin))
        r.beams = sorted(beams, key=lambda b: -b.score)[: p.return_beams]
        r.planned, r.planned_finish = list(r.beams[0].output_ids), r.beams[0].finish_reason

    def _script(self, ids: list[int], p: SamplingParams) -> list[int]:
        """What the "model" says: the responder's text tokenized (checked against the
        request's grammar), or its ids; under a trie constraint one of the trie's sequences."""
        try:
            out = self.responses(self._prompt(ids), p)
        except Exception as e:  # noqa: BLE001 - the test's responder failed: its caller's ValueError
            raise Refused({"type": "abort", "status_code": 400,
                           "message": f"responder: {type(e).__name__}: {e}"}) from None
        if isinstance(out, str):
            if p.grammar is not None:
                out = grammar_text(*p.grammar, out, budget=4 * p.max_new_tokens + 16)
            script = self.tokenizer.encode(out, add_special_tokens=False)
        else:
            script = [int(t) for t in out]
        return script if p.constraint is None else self._trie_sequence(p.constraint, script)

    def _trie_sequence(self, c: TrieConstraint, script: list[int]) -> list[int]:
        seqs = c.sequences if c.sequences is not None else self.tries.get(c.name or "")
        if seqs is None:
            raise Refused({"type": "abort", "status_code": 400, "message": f"constraint.name: no trie is kept under "
                           f"{c.name!r} (send its sequences with the name once; at most {MAX_NAMED_TRIES} names "
                           "are kept)"})
        if c.name is not None:
            self.tries[c.name] = seqs
        return script if script in seqs else seqs[0]

    def _prompt(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    # ---- steps ---------------------------------------------------------------------------

    def _admit(self) -> None:
        """Waiting requests into the room left, oldest first; a retracted one (its output
        kept) gets its next token `first_token_s` after its prefill is redone."""
        assert self.loop is not None
        while self.control.admits and self.waiting and len(self.running) < self.model.max_running_requests:
            r = self.waiting.popleft()
            self.running.append(r)
            r.admitted = True
            ids, s = r.msg.input_ids, r.logprob_start
            # Prompt logprobs need the logits of the positions they score: no cache hit there.
            hit = self.memory.match(ids[: min(len(ids) - 1, max(s - 1, 0)) if s >= 0 else len(ids) - 1],
                                    r.msg.lora_path)
            r.cached = max(r.cached, hit)
            self.memory.insert(ids, r.msg.lora_path)
            slow = [e.seconds for e in r.effects if isinstance(e, SlowFirstToken)] if not r.output_ids else []
            r.due = self.loop.time() + (max(slow) if slow else self.latency.first_token_s)
            if not r.planned:  # a prefill for prompt logprobs only
                self._prompt_logprobs(r)
                self._finish(r, r.planned_finish)

    def _step(self, r: _Run, now: float) -> None:
        """The request's next token, or the fault planted for this point of its output."""
        n = len(r.output_ids)
        for e in r.effects:
            if isinstance(e, (Die, Hang, Abort, Fail)) and e.after_tokens == n:
                if isinstance(e, Die):
                    self._die(f"a planted fault after {n} tokens of request {r.msg.rid!r}")
                elif isinstance(e, Hang):
                    r.due = None
                else:
                    self.failures += isinstance(e, Fail)
                    self._finish(r, {"type": "abort", "message": e.message if isinstance(e, Abort) else e.reason})
                return
        if n == 0:
            self._prompt_logprobs(r)
        tok = r.planned[n]
        r.output_ids.append(tok)
        if r.logprobs is not None:
            self._add_logprob(r, tok, len(r.msg.input_ids) + n, into="output")
        r.due = now + self.latency.per_token_s
        if len(r.output_ids) == len(r.planned):
            if r.beams is not None:
                r.sent = len(r.output_ids)  # the beams carry the ids
            self._finish(r, r.planned_finish)
        elif r.msg.stream:
            self.outbox[r] = None

    def _end(self, r: _Run, reason: FinishReason) -> None:
        r.finished = reason
        if r.logprobs is not None:  # as the scheduler's: a prompt's logprobs all, or none
            r.logprobs.whole_prompt_or_none(len(r.msg.input_ids) - r.logprob_start)
        self.outbox[r] = None

    def _finish(self, r: _Run, reason: FinishReason) -> None:
        """End a live request (its KV cached unless aborted)."""
        self._end(r, reason)
        self.live.pop(r.msg.rid, None)
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        if reason["type"] != "abort" and r.admitted:  # its KV goes into the tree: all but the last token's
            self.memory.insert(r.msg.input_ids + r.output_ids[:-1], r.msg.lora_path)
            held = sum(len(x.msg.input_ids) + len(x.output_ids) for x in self.running)
            if self.memory.size + held > self.model.max_total_tokens:
                self.memory.flush()  # evicted

    def abort_all(self, message: str) -> int:
        """End every live request with an abort reason, now; how many."""
        live = list(self.live.values())
        for r in live:
            self._finish(r, {"type": "abort", "message": message})
        return len(live)

    def retract_all(self) -> int:
        """Send every running request back to the queue, its output kept, oldest first in it."""
        holders = sorted(self.running, key=lambda r: r.arrival, reverse=True)
        for r in holders:  # youngest first: each goes to the front of the queue
            self.running.remove(r)
            self.waiting.appendleft(r)
        return len(holders)

    def _die(self, why: str) -> None:
        self.dead = True
        self.live, self.waiting, self.running, self.outbox = {}, deque(), [], {}
        self.on_death(f"the scheduler died ({why}); every pending request failed. Start a new engine.")

    # ---- output --------------------------------------------------------------------------

    def flush(self) -> None:
        """The outbox as one message, each request's ids and logprobs since its last (the
        scheduler's Outbox.flush, sgl/sched/results.py)."""
        if not self.outbox or self.dead:
            return
        runs, self.outbox = list(self.outbox), {}
        out = BatchTokenIDOutput([], [], [], [], [], [], [], [], [], [], [], [], [],
                                 weight_version=self.control.weight_version)
        for r in runs:
            p = r.msg.sampling_params
            out.rids.append(r.msg.rid)
            out.new_ids.append(r.output_ids[r.sent:])
            r.sent = len(r.output_ids)
            out.finished_reasons.append(r.finished)
            out.prompt_tokens.append(len(r.msg.input_ids))
            out.completion_tokens.append(len(r.output_ids))
            out.cached_tokens.append(r.cached)
            out.skip_special_tokens.append(p.skip_special_tokens)
            out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
            out.no_stop_trim.append(p.no_stop_trim)
            out.stop_strs.append(p.stop_strs)
            out.detokenize.append(r.msg.detokenize)
            out.logprobs.append(r.logprobs)
            out.beams.append(r.beams if r.finished is r.planned_finish else None)  # an aborted one sends none
            if r.logprobs is not None:
                r.logprobs = Logprobs()
        self.send.send(out)

    def _prompt_logprobs(self, r: _Run) -> None:
        ids, s = r.msg.input_ids, r.logprob_start
        if r.logprobs is not None and s >= 0:
            for q in range(max(s, 1), len(ids)):
                self._add_logprob(r, ids[q], q, into="input")

    def _add_logprob(self, r: _Run, tok: int, position: int | None, into: str) -> None:
        """One position's logprobs in the real shapes: the token's, the top k (the token
        first), the asked ids'; all None for the first prompt token (`position` None)."""
        lp, k, asked = r.logprobs, r.msg.top_logprobs_num, r.msg.token_ids_logprob or []
        assert lp is not None
        rows: tuple[list[Any], ...] = (lp.input_vals, lp.input_top_vals, lp.input_top_ids, lp.input_ids_vals) \
            if into == "input" else (lp.output_vals, lp.output_top_vals, lp.output_top_ids, lp.output_ids_vals)
        if into == "input":
            lp.input_ids.append(tok)
        v = None if position is None else token_logprob(tok, position)
        rows[0].append(v)
        if k:
            rows[1].append(None if v is None else [v - i for i in range(k)])
            rows[2].append(None if v is None else [(tok + i) % self.model.vocab_size for i in range(k)])
        if asked:
            rows[3].append(None if v is None else [v if t == tok else v - 8.0 for t in asked])

    # ---- control calls -------------------------------------------------------------------

    def _control(self, msg: FlushCacheReq | GetServerInfoReq | HealthCheckReq) -> None:
        call: ControlCall = "flush_cache" if isinstance(msg, FlushCacheReq) else "server_info" \
            if isinstance(msg, GetServerInfoReq) else "health"
        effects = self.faults.for_control(call)
        if any(isinstance(e, Die) for e in effects):
            self._die(f"a planted fault at a {call} call")
        if any(isinstance(e, (Die, Hang)) for e in effects):
            return
        if isinstance(msg, FlushCacheReq):
            idle = not self.live
            if idle:
                self.memory.flush()
            self.send.send(FlushCacheReqOutput(idle, "" if idle else "cannot flush the cache while requests are "
                                               "running or waiting", msg.origin, msg.req_id))
        elif isinstance(msg, GetServerInfoReq):
            self.send.send(GetServerInfoReqOutput(self.info(), msg.origin, msg.req_id))
        else:
            self.send.send(HealthCheckOutput(True, msg.origin, msg.req_id))

    def info(self) -> dict[str, Any]:
        """The scheduler's server info, in its keys (those a fake can fill)."""
        m, a = self.model, self.args
        held = sum(len(r.msg.input_ids) + len(r.output_ids) for r in self.running)
        return {"model_path": a.model_path, "max_queued_requests": a.max_queued_requests,
                "max_top_logprobs_num": a.max_top_logprobs_num, "device": "none", "vocab_size": m.vocab_size,
                "context_length": m.context_length, "max_total_tokens": m.max_total_tokens,
                "max_running_requests": m.max_running_requests,
                "eos_token_ids": m.eos_ids, "kv_free": max(0, m.max_total_tokens - held - self.memory.size),
                "kv_evictable": self.memory.size, "kv_protected": held, "invariant_violations": 0,
                "waiting": len(self.waiting), "running": len(self.running), "failures": self.failures,
                **self.control.info()}
