"""The scheduler state machine (tests/test_scheduler_machine.py) with the control plane
in its rules: pause in each mode (at times refusing new requests), continue, abort
all, weight updates from disk (the same checkpoint again, so every request's output
must still equal the reference's), and releasing and resuming memory.

Besides every check of the base machine after each step (KV accounting, locks, rows,
token/KV alignment, no request lost) it proves:
- every control call is answered exactly once, and the calls that must succeed do
  (a KV release while requests hold KV is refused and changes nothing);
- once a pause is answered and until a continue is, no token is produced;
- while the KV pool is released nothing holds KV and nothing runs;
- retract and in-place pauses lose nothing: those requests end with exactly the
  output they would have had alone; "abort" pauses and abort-all end requests with an
  abort reason and a prefix of that output; refused ones get a 503 abort and no output;
- the weight version counts the updates, and at the end the idle KV balances."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from sgl.core.protocol import (
    AbortAllReq,
    BatchTokenIDOutput,
    ContinueGenerationReq,
    ControlReqOutput,
    Message,
    PauseGenerationReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    UpdateWeightsFromDiskReq,
)
from tests.test_scheduler_machine import REFERENCES, Reference, SchedulerMachine, fail, machine_settings
from tests.test_scheduler_machine import model_dir as model_dir

COUNTS: Counter[str] = Counter()  # control calls answered, by type and outcome
SKIP = st.integers(0, 2)  # most draws of a control rule do nothing: requests get to run between calls
TAGS = st.sampled_from([None, ["kv_cache"], ["weights"], ["weights", "kv_cache"]])


class ControlMachine(SchedulerMachine):
    def __init__(self) -> None:
        super().__init__()
        # Sent and not answered yet, by req_id: the call and whether it must succeed (None: either).
        # A weight update that waits for the running requests is answered after later calls.
        self.calls: dict[int, tuple[Message, bool | None]] = {}
        self.sent = 0
        self.paused = False  # as of the last message queued
        self.refuse_new = False
        self.acked_pause = False  # as of the last answer consumed
        self.released: set[str] = set()  # as of the last answer consumed
        self.frozen = False  # no token may appear: a pause or a release answered, not undone yet
        self.updates = 0  # answered with success

    def _control(self, msg: Message, must: bool | None) -> None:
        self.sent += 1
        msg.req_id = self.sent  # type: ignore[union-attr]
        self.calls[self.sent] = (msg, must)
        self.recv.q.append(msg)

    def _settled(self) -> bool:
        return not self.calls

    # ---- rules ----

    @rule(mode=st.sampled_from(["abort", "retract", "in_place"]), refuse_new=st.booleans(), skip=SKIP)
    def pause(self, mode: str, refuse_new: bool, skip: int) -> None:
        if skip:
            return
        if mode == "abort":  # everything submitted so far ends, or may have finished first
            for sub in self.subs.values():
                sub.aborted = True
        self.paused, self.refuse_new = True, refuse_new
        self._control(PauseGenerationReq(mode=mode, refuse_new=refuse_new), True)  # type: ignore[arg-type]

    @precondition(lambda self: self.paused)
    @rule()
    def resume_generation(self) -> None:
        self.paused = self.refuse_new = False
        self._control(ContinueGenerationReq(), True)

    @rule(skip=SKIP)
    def abort_all(self, skip: int) -> None:
        if skip:
            return
        for sub in self.subs.values():
            sub.aborted = True
        self._control(AbortAllReq(), True)

    @rule(flush=st.booleans(), abort_first=st.sampled_from([False, False, True]), skip=SKIP)
    def update_weights(self, flush: bool, abort_first: bool, skip: int) -> None:
        if skip:
            return
        if abort_first:
            for sub in self.subs.values():
                sub.aborted = True
        must = "weights" not in self.released if self._settled() else None
        self._control(UpdateWeightsFromDiskReq(model_path=self.MODEL, flush_cache=flush,
                                               abort_all_requests=abort_first), must)

    @precondition(lambda self: self._settled())
    @rule(tags=TAGS, skip=SKIP)
    def release(self, tags: list[str] | None, skip: int) -> None:
        if skip:
            return
        want = set(tags or ("weights", "kv_cache"))
        # Refused when a tag is released already; a KV release also when requests hold KV then.
        self._control(ReleaseMemoryReq(tags=tags), False if want & self.released else None)  # type: ignore[arg-type]

    @precondition(lambda self: self._settled() and self.released)
    @rule()
    def resume(self) -> None:
        self._control(ResumeMemoryReq(tags=sorted(self.released)), True)  # type: ignore[arg-type]

    def _refusing(self) -> bool:
        return self.refuse_new and self.paused

    # ---- checks on what is sent ----

    def _consume(self) -> None:
        if self.frozen:
            self._check_frozen(self.seen)
        super()._consume()
        s = self.s
        assert s is not None
        if "kv_cache" in s.runner.released and (s.decode.holders() or s.last is not None):
            raise fail("released", f"requests hold KV with the pool released: {s.decode.holders()}")

    def _other(self, out: Any, at: int) -> None:
        if not isinstance(out, ControlReqOutput):
            super()._other(out, at)
        if out.req_id not in self.calls:
            raise fail("control", f"an answer to no call waiting for one: {out}")
        msg, must = self.calls.pop(out.req_id)
        COUNTS[f"{type(msg).__name__}{'' if out.success else ' refused'}"] += 1
        if must is not None and out.success != must:
            raise fail("control", f"{type(msg).__name__} answered {out.success}, expected {must}: {out.message}")
        if out.success:
            if isinstance(msg, PauseGenerationReq):
                self.acked_pause = True
            elif isinstance(msg, ContinueGenerationReq):
                self.acked_pause = False
            elif isinstance(msg, ReleaseMemoryReq):
                self.released |= set(msg.tags or ("weights", "kv_cache"))
            elif isinstance(msg, ResumeMemoryReq):
                self.released -= set(msg.tags or ())
            elif isinstance(msg, UpdateWeightsFromDiskReq):
                self.updates += 1
                if out.data["weight_version"] != str(self.updates):
                    raise fail("control", f"weight version {out.data['weight_version']} after {self.updates} updates")
        self.frozen = self.acked_pause or bool(self.released)
        if self.frozen:
            self._check_frozen(at + 1)

    def _check_frozen(self, start: int) -> None:
        """The outputs sent from `start` up to the next answer, while frozen: no token is
        produced. A request ending by an abort then may carry the ids it made before (a
        non-streaming one sends them all at its end); nothing else carries any."""
        for m in self.send.msgs[start:]:
            if isinstance(m, ControlReqOutput):
                return  # what follows is checked as that answer leaves the state
            if not isinstance(m, BatchTokenIDOutput):
                continue
            for rid, new, reason in zip(m.rids, m.new_ids, m.finished_reasons):
                ended = reason is not None and reason["type"] == "abort" and not self.subs[rid].stream
                if new and not ended:
                    raise fail("frozen", f"{rid} got tokens while paused or released: {new} {reason}")

    # ---- the end ----

    def _finish(self) -> None:
        s = self.s
        assert s is not None
        for _ in range(64):  # every call answered (a waiting update: once the running requests end)
            if self._settled() and not self.recv.q:
                break
            self._step()
        if self.released:
            self.resume()
        if self.paused:
            self.resume_generation()
        super()._finish()
        if not self._settled():
            raise fail("control", f"never answered: {list(self.calls.values())}")
        if s.control.frozen or s.control.waiting_updates:
            raise fail("control", f"still frozen at the end: {s.control.info()}")


def control_machine(model: str, overlap: bool) -> type[ControlMachine]:
    REFERENCES.setdefault(model, Reference(model))
    name = f"ControlMachine{'Overlap' if overlap else 'Plain'}"
    return type(name, (ControlMachine,), {"OVERLAP": overlap, "MODEL": model})


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_control_state_machine(model_dir: str, overlap: bool) -> None:
    before = COUNTS.copy()
    run_state_machine_as_test(control_machine(model_dir, overlap), settings=machine_settings())
    print(f"overlap={overlap}: {dict(COUNTS - before)}")
