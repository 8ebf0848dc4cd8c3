"""Faults on demand in the scheduler: the FaultPlan a test installed (a SetFaultsReq,
sgl.core.faults) applied where real failures happen, so that the engine's own paths
handle them. Busy is refused at intake as a full queue refuses; Abort ends the request
through the abort path; Fail makes the request's next batch fail in its stage, inside
the scheduler's containment; Die raises out of the loop, so the role ends and the
watchdog fails every call; Hang parks the request (no further output, its KV kept
until its caller aborts it); SlowFirstToken holds the request back from the queue.

While no plan is installed the scheduler consults nothing here but `plan is None`
(aborts and the idle checks still ask about requests a removed plan left hung)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from sgl.core.faults import (
    Abort,
    ControlCall,
    Die,
    Effect,
    Fail,
    FaultPlan,
    FaultSpec,
    Hang,
    SlowFirstToken,
    control_misuse,
)
from sgl.sched.batch import ScheduleBatch
from sgl.sched.decode import DecodeManager
from sgl.sched.grammar import Grammars
from sgl.sched.prefill import PrefillManager
from sgl.sched.req import Req


class PlantedDeath(RuntimeError):
    """The scheduler dies of a planted fault."""


class FaultInjector:
    """The installed plan and the requests it acts on. `queue` queues an accepted request,
    `abort` ends one as a client's abort does: the scheduler's."""

    def __init__(self, prefill: PrefillManager, decode: DecodeManager, grammars: Grammars,
                 queue: Callable[[Req], None], abort: Callable[[Req, str], None], tp_size: int) -> None:
        self.plan: FaultPlan | None = None
        self.prefill = prefill
        self.decode = decode
        self.grammars = grammars
        self.queue = queue
        self.abort = abort
        self.tp_size = tp_size
        self.armed: dict[Req, list[Die | Hang | Abort]] = {}  # each fires once the request has its after_tokens
        self.fails: dict[Req, list[Fail]] = {}  # each fails a batch holding the request, at its stage
        self.delayed: dict[Req, float] = {}  # SlowFirstToken: queued at this time.monotonic()
        self.hung: dict[Req, None] = {}  # no further output; KV held until the caller aborts

    def install(self, specs: list[FaultSpec] | None) -> str | None:
        """Replace the plan (None: remove it); why it is refused, or None. The old plan's
        armed effects go and the requests it held back are queued now; hung ones stay
        hung until their callers abort them."""
        for s in specs or ():
            if (why := control_misuse(s.effect, s.when)) is not None:
                return why
            if isinstance(s.effect, SlowFirstToken) and self.tp_size > 1:
                return ("SlowFirstToken is refused with tensor parallelism: each rank would admit the request "
                        "on its own clock, and the ranks must take the same batches")
        self.plan = FaultPlan.from_specs(specs) if specs is not None else None
        self.armed.clear()
        self.fails.clear()
        delayed, self.delayed = list(self.delayed), {}
        for req in delayed:
            self.queue(req)
        return None

    # ---- generate requests -------------------------------------------------------

    def arrive(self, req: Req) -> list[Effect]:
        """The plan's effects for a request that just arrived (each counts as fired). The
        scheduler has no prompt text: a selector sees prompt ""."""
        assert self.plan is not None
        return self.plan.for_request(req.rid, req.origin_input_ids, "", req.sampling_params, req.stream)

    def accept(self, req: Req, effects: list[Effect]) -> bool:
        """Arm an accepted request's effects; True if SlowFirstToken holds it back (`step`
        queues it in time), False if the scheduler queues it now."""
        for e in effects:
            if isinstance(e, Fail):
                self.fails.setdefault(req, []).append(e)
            elif isinstance(e, (Die, Hang, Abort)):
                self.armed.setdefault(req, []).append(e)
        slow = max((e.seconds for e in effects if isinstance(e, SlowFirstToken)), default=0.0)
        if slow <= 0:
            return False
        self.delayed[req] = time.monotonic() + slow
        return True

    def step(self) -> None:
        """Once a turn, before scheduling: queue the held-back requests whose time came,
        then fire each armed effect whose request has its after_tokens (the tokens so far
        were sent at the end of the last turn): Abort aborts, Hang parks, Die raises."""
        if self.delayed:
            now = time.monotonic()
            for req in [r for r, at in self.delayed.items() if at <= now]:
                del self.delayed[req]
                self.queue(req)
        for req in [r for r in self.fails if r.finished]:
            del self.fails[req]
        for req, effects in list(self.armed.items()):
            if req.finished or req.to_abort is not None:
                del self.armed[req]
                continue
            e = next((e for e in effects if len(req.output_ids) >= e.after_tokens), None)
            if e is None:
                continue
            del self.armed[req]
            if isinstance(e, Die):
                raise PlantedDeath(f"a planted fault after {len(req.output_ids)} tokens of request {req.rid!r}")
            if isinstance(e, Abort):
                self.abort(req, e.message)
            else:
                self._park(req)

    def _park(self, req: Req) -> None:
        """Hang: the request leaves the queue, the compiler, the prefill or the running set
        for good, keeping what KV it holds; results in flight for it are dropped."""
        self.fails.pop(req, None)
        if self.delayed.pop(req, None) is None and not (self.prefill.unqueue(req) or self.grammars.drop(req)):
            self.prefill.remove(req)
            self.decode.remove(req)
            req.epoch += 1  # its launched batches' results are stale: no further output
        self.hung[req] = None

    def release(self, req: Req) -> bool:
        """Whether the request was held back or hung here; it is no longer (its caller aborted it)."""
        if req in self.hung:
            del self.hung[req]
            return True
        return self.delayed.pop(req, None) is not None

    def strike(self, batch: ScheduleBatch, stage: str) -> None:
        """Raise the planted error of a Fail armed for `stage` on a request of `batch` that
        has its after_tokens, as that stage would raise it (called inside the stage's
        containment). A batch whose entry of a request is stale (the request retracted or
        ended since its launch) no longer computes for it: that request's faults wait."""
        if not self.fails:
            return
        for req, epoch in dict.fromkeys(zip(batch.reqs, batch.epochs)):
            if req.finished or req.epoch != epoch:
                continue
            fails = self.fails.get(req, [])
            due = next((f for f in fails if f.stage == stage and len(req.output_ids) >= f.after_tokens), None)
            if due is not None:
                fails.remove(due)
                if not fails:
                    del self.fails[req]
                raise planted_error(due)

    def first_due_s(self) -> float | None:
        """Seconds until the next held-back request is due (0 if one is), None if none is held back."""
        if not self.delayed:
            return None
        return max(0.0, min(self.delayed.values()) - time.monotonic())

    # ---- control calls -----------------------------------------------------------

    def control(self, call: ControlCall) -> bool:
        """Whether a control call goes unanswered (Hang); Die raises instead."""
        assert self.plan is not None
        effects = self.plan.for_control(call)
        if any(isinstance(e, Die) for e in effects):
            raise PlantedDeath(f"a planted fault at a {call} call")
        return any(isinstance(e, Hang) for e in effects)


def planted_error(fail: Fail) -> Exception:
    """The exception a failing stage raises for `fail`: its type by name, its text."""
    if fail.error == "OutOfMemoryError":
        return torch.cuda.OutOfMemoryError(fail.message)
    return RuntimeError(fail.message)
