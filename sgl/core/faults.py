"""Faults on demand: a plan of what goes wrong, and for which request, that an engine's
scheduler consults as requests arrive and produce tokens: a FakeEngine's scripted one,
or a real one's (sgl.sched.faults, installed by a SetFaultsReq).

A `Fault` pairs an effect (the engine dies, a full queue refuses the request, the
request or a control call gets no answer, the request is aborted or its batch fails
after some tokens, its first token is slow) with a selector (every request, the nth,
a rid, a control call, or a predicate on the request) and how many times it may fire.
Effects and the selectors other than `Where` are msgspec Structs, so a plan is data
(`FaultPlan.specs`) that travels to a real scheduler as every message does, encoded;
`Where` holds a Python predicate and works with a FakeEngine only.

Data and matching only: it never sleeps, sends or ends a request itself (the engine
side that consults it does), and imports neither torch nor any engine."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from sgl.core.sampling_params import SamplingParams

ControlCall = Literal["flush_cache", "server_info", "health"]
# Where a real engine's batch can fail (sgl.sched.scheduler's containment), and what it raises.
FailStage = Literal["prepare", "forward", "result processing"]
FailError = Literal["RuntimeError", "OutOfMemoryError"]

# ---- effects -------------------------------------------------------------------------


class Die(msgspec.Struct, tag="die", frozen=True):
    """The engine dies once the request has `after_tokens` output tokens (0: when its
    first token would come; a control call: instead of its answer): that call and every
    pending and later one raise `sgl.EngineDeadError`."""

    after_tokens: int = 0


class Busy(msgspec.Struct, tag="busy", frozen=True):
    """The request is refused as a full waiting queue refuses it: `sgl.ServerBusyError`
    (HTTP 503)."""


class Hang(msgspec.Struct, tag="hang", frozen=True):
    """No further output once the request has `after_tokens` tokens, and for a control
    call no answer: the caller's own timeout fires (a control call's `TimeoutError`
    after `control_timeout`, a stream's wait until the caller gives up and aborts)."""

    after_tokens: int = 0


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """The request ends after `after_tokens` tokens with finish_reason
    `{"type": "abort", "message": message}`, as an abort from the client ends it."""

    after_tokens: int = 0
    message: str = "aborted by the client"


class Fail(msgspec.Struct, tag="fail", frozen=True):
    """The request's batch fails in `stage` after `after_tokens` tokens: the request
    ends with the abort reason a failed batch gives, "internal error in forward
    (RuntimeError): a planted fault", and the engine goes on serving. On a real engine
    the whole batch fails (its other requests end alike), and an OutOfMemoryError is
    a CUDA out-of-memory: the batch's requests are retracted once first."""

    after_tokens: int = 0
    stage: FailStage = "forward"
    error: FailError = "RuntimeError"
    message: str = "a planted fault"

    @property
    def reason(self) -> str:
        return f"internal error in {self.stage} ({self.error}): {self.message}"


class SlowFirstToken(msgspec.Struct, tag="slow_first_token", frozen=True):
    """The request's first token comes `seconds` after it arrived (loop time: virtual
    under a virtual-time loop)."""

    seconds: float


Effect = Die | Busy | Hang | Abort | Fail | SlowFirstToken

# ---- selectors -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultRequest:
    """What a selector sees of a generate request as it reaches the scheduler side.
    `index` counts generate requests from 1 in arrival order (each sample of n > 1
    is one); `prompt` is the prompt's ids decoded ("" in a real engine's scheduler)."""

    rid: str
    index: int
    input_ids: list[int]
    prompt: str
    sampling_params: SamplingParams
    stream: bool


class Always(msgspec.Struct, tag="always", frozen=True):
    """Every generate request."""

    def matches(self, req: FaultRequest) -> bool:
        return True


class Nth(msgspec.Struct, tag="nth", frozen=True):
    """The `n`th generate request (from 1), or with `every` each nth one."""

    n: int
    every: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"Nth.n={self.n} is invalid: must be >= 1")

    def matches(self, req: FaultRequest) -> bool:
        return req.index % self.n == 0 if self.every else req.index == self.n


class Rid(msgspec.Struct, tag="rid", frozen=True):
    """The call made with `rid`: its request, or each sample of it ("<rid>-<i>") with n > 1."""

    rid: str

    def matches(self, req: FaultRequest) -> bool:
        head, _, tail = req.rid.rpartition("-")
        return req.rid == self.rid or (head == self.rid and tail.isdigit())


class Control(msgspec.Struct, tag="control", frozen=True):
    """A control call (`flush_cache`, `server_info` or `health`), never a generate request."""

    call: ControlCall

    def matches(self, req: FaultRequest) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Where:
    """The generate requests for which `predicate` is true (a FakeEngine's only: a predicate is no data)."""

    predicate: Callable[[FaultRequest], bool]

    def matches(self, req: FaultRequest) -> bool:
        return bool(self.predicate(req))


Selector = Always | Nth | Rid | Control | Where
DataSelector = Always | Nth | Rid | Control  # those a plan sent to a real engine may hold


@dataclass(slots=True)
class Fault:
    """One planted fault: `effect` on what `when` selects, at most `times` times (None: always)."""

    effect: Effect
    when: Selector
    times: int | None = None
    fired: int = 0

    @property
    def spent(self) -> bool:
        return self.times is not None and self.fired >= self.times


class FaultSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A fault as data, what a real engine's scheduler is sent (its count of firings starts at 0)."""

    effect: Effect
    when: DataSelector
    times: int | None = None


def control_misuse(effect: Effect, when: Selector) -> str | None:
    """Why `effect` cannot apply to what `when` selects, or None."""
    if isinstance(when, Control) and isinstance(effect, (Busy, Abort, Fail, SlowFirstToken)):
        return f"{type(effect).__name__} is for generate requests: a control call can only die or hang"
    return None


class FaultPlan:
    """The faults an engine applies, consulted as each request arrives. Faults may be
    added while the engine runs; each applies to the requests that arrive after it.

    `fired` lists what fired, in order: (the effect, the rid or control call)."""

    def __init__(self, *faults: Fault) -> None:
        self.faults: list[Fault] = list(faults)
        self.fired: list[tuple[Effect, str]] = []
        self._arrivals = itertools.count(1)

    def add(self, effect: Effect, when: Selector | None = None, times: int | None = None) -> Fault:
        """Plant `effect` for what `when` selects (every request by default), at most `times` times."""
        when = when if when is not None else Always()
        if (why := control_misuse(effect, when)) is not None:
            raise ValueError(why)
        fault = Fault(effect, when, times)
        self.faults.append(fault)
        return fault

    def specs(self) -> list[FaultSpec]:
        """The plan's faults as data for a real engine, each with its `times` (what fired
        here is not counted there); ValueError for a `Where` selector or a value the
        engine's messages do not allow."""
        out = []
        for f in self.faults:
            if isinstance(f.when, Where):
                raise ValueError("Where holds a Python predicate, and a real engine's scheduler gets its plan "
                                 "as an encoded message on every transport (inproc too): select with Always, "
                                 "Nth, Rid or Control there (Where works with a FakeEngine)")
            out.append(FaultSpec(f.effect, f.when, f.times))
        try:  # encoding checks no value: decoding does, as the scheduler's receiver would
            return msgspec.convert(msgspec.to_builtins(out), list[FaultSpec])
        except msgspec.ValidationError as e:
            raise ValueError(f"fault plan: {e}") from None

    @classmethod
    def from_specs(cls, specs: list[FaultSpec]) -> FaultPlan:
        """A plan of these faults, none fired yet, arrivals counted from 1."""
        return cls(*(Fault(s.effect, s.when, s.times) for s in specs))

    def next_request(self, effect: Effect) -> Fault:
        """Plant `effect` for the next generate request alone."""
        return self.add(effect, Always(), times=1)

    def for_request(self, rid: str, input_ids: list[int], prompt: str, params: SamplingParams,
                    stream: bool) -> list[Effect]:
        """The effects for a generate request that just arrived (each counts as fired)."""
        req = FaultRequest(rid, next(self._arrivals), input_ids, prompt, params, stream)
        return self._fire(lambda f: not isinstance(f.when, Control) and f.when.matches(req), rid)

    def for_control(self, call: ControlCall) -> list[Effect]:
        """The effects for a control call that just arrived (each counts as fired)."""
        return self._fire(lambda f: isinstance(f.when, Control) and f.when.call == call, call)

    def _fire(self, selects: Callable[[Fault], bool], what: str) -> list[Effect]:
        out = []
        for f in self.faults:
            if not f.spent and selects(f):
                f.fired += 1
                self.fired.append((f.effect, what))
                out.append(f.effect)
        return out
