"""Request priority (schedule_policy="priority") and deadlines (a request's `timeout`,
the server's request_timeout).

The scheduler state machine (tests/test_scheduler_machine.py) with priorities and
timeouts on its requests and a clock that advances one second per scheduler step.
Besides every check of the base machine after each step (KV accounting, locks, rows,
token/KV alignment, no request lost) and at its end (liveness, outputs equal to the
reference's, the idle KV balance) it proves:
- deadlines: a request with a deadline D ends by the end of the first step whose
  clock is past D plus one step, and none ends by its deadline before D;
- admission order under the priority policy: when a round admits a request, every
  request of higher priority that waited in that round was admitted too, or deferred
  (waiting for a shared prefix in flight or its n > 1 leader: by design);
- an expired request's output is a prefix of its reference output; a request whose
  timeout is out of range is refused with no output.

Then the request field paths on a null engine: the engine option, /generate and the
OpenAI routes, their refusals, and a deadline on a waiting, a running and a compiling
request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule, run_state_machine_as_test

import sgl
from sgl.core.protocol import GenerateReqInput
from sgl.core.server_args import ServerArgs
from sgl.sched.grammar import Grammars
from sgl.sched.prefill import PrefillAdder, Verdict
from sgl.sched.req import Req
from sgl.sched.scheduler import Scheduler
from sgl.testing import BackgroundEngine, ServedApp, null_model_dir
from tests.conftest import null_continuation
from tests.fake_channels import ListSender, QueueReceiver
from tests.test_scheduler_machine import (
    BASES,
    CONTEXT,
    MAX_NEW,
    REFERENCES,
    VOCAB,
    Key,
    Reference,
    SchedulerMachine,
    Sub,
    fail,
    machine_settings,
    params,
)
from tests.test_scheduler_machine import model_dir as model_dir

DEADLINE = "deadline: "
TIMEOUTS = st.sampled_from([None, None, 1.0, 2.0, 4.0, 9.0, 25.0, 0.0, -1.0])  # 0, -1: refused


class PriorityMachine(SchedulerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0  # the scheduler's clock: one second per step
        self.due: dict[str, float] = {}  # rid -> deadline on that clock
        self.rounds: list[tuple[list[Req], list[tuple[Req, Verdict]]]] = []  # this step's admission rounds

    @initialize(cfg=st.fixed_dictionaries({
        "max_total_tokens": st.integers(100, 220),
        "max_running_requests": st.integers(1, 6),
        "chunked_prefill_size": st.sampled_from([8, 16, 40, None]),
        "max_prefill_tokens": st.integers(16, 128),
        "schedule_policy": st.sampled_from(["priority", "priority", "priority", "fcfs"]),
        "disable_radix_cache": st.sampled_from([False, False, True]),
    }))
    def build(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        args = ServerArgs.from_kwargs(model_path=self.MODEL, device="cpu", skip_tokenizer_init=True,
                                      context_length=CONTEXT, random_seed=0,
                                      disable_overlap_schedule=not self.OVERLAP, enable_mixed_chunk=self.MIXED, **cfg)
        self.recv, self.send = QueueReceiver(), ListSender()
        self.s = Scheduler(args, self.MODEL, self.recv, self.send, clock=lambda: self.now)

    @rule(base=st.integers(0, len(BASES) - 1), trim=st.sampled_from([0, 3, 11]),
          suffix=st.lists(st.integers(1, VOCAB - 2), max_size=6), n=st.sampled_from([1, 1, 1, 2]),
          max_new=MAX_NEW, priority=st.integers(-2, 2), timeout=TIMEOUTS, stream=st.booleans())
    def submit(self, base: int, trim: int, suffix: list[int], n: int, max_new: int, priority: int,  # type: ignore[override]
               timeout: float | None, stream: bool) -> None:
        b = BASES[base]
        ids = (b[: max(0, len(b) - trim)] + suffix) or [1]
        key: Key = (tuple(ids), max_new, (), True)
        total = min(CONTEXT, self.cfg["max_total_tokens"])
        refused = len(ids) + max(max_new, 1) > total or (timeout is not None and timeout <= 0)
        rid = f"q{self.groups}"
        self.groups += 1
        rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        for i, r in enumerate(rids):
            self.subs[r] = Sub(key, stream, refused)
            self.order.append(r)
            if timeout is not None and not refused:
                self.due[r] = self.now + 1 + timeout  # received in the next step
            self.recv.q.append(GenerateReqInput(r, ids, params(key), stream=stream,
                                                prefix_leader=rids[0] if i else None, priority=priority,
                                                timeout=timeout))
            self.tokens_asked += len(ids) + max_new

    def _step(self) -> None:
        self.now += 1.0
        self.rounds = []
        add_waiting, add_one = PrefillAdder.add_waiting, PrefillAdder.add_one
        rounds = self.rounds

        def spy_round(adder: PrefillAdder, waiting: list[Req], policy: str) -> None:
            rounds.append((list(waiting), []))
            add_waiting(adder, waiting, policy)

        def spy_one(adder: PrefillAdder, req: Req) -> Verdict:
            verdict = add_one(adder, req)
            if rounds:
                rounds[-1][1].append((req, verdict))
            return verdict

        PrefillAdder.add_waiting, PrefillAdder.add_one = spy_round, spy_one  # type: ignore[method-assign]
        try:
            super()._step()
        finally:
            PrefillAdder.add_waiting, PrefillAdder.add_one = add_waiting, add_one  # type: ignore[method-assign]
        try:
            self._check_deadlines()
            self._check_order()
        except AssertionError:
            self.broken = True
            raise

    def _check_deadlines(self) -> None:
        for rid, due in self.due.items():
            sub = self.subs[rid]
            f = sub.finish
            if f is None and self.now >= due + 1:
                raise fail("deadline", f"{rid} not finished at {self.now}, its deadline {due}")
            if f is not None and f["type"] == "abort" and f["message"].startswith(DEADLINE) and not sub.aborted:
                if "ended at" not in f:
                    if self.now < due:
                        raise fail("deadline", f"{rid} ended by its deadline {due} at {self.now}")
                    f["ended at"] = self.now
                sub.aborted = True  # its output: a prefix of the reference's (the base machine's end checks)

    def _check_order(self) -> None:
        if self.cfg["schedule_policy"] != "priority":
            return
        for queue, verdicts in self.rounds:
            got = dict((id(r), v) for r, v in verdicts)
            admitted = [r for r, v in verdicts if v in (Verdict.ADMITTED, Verdict.CHUNKED)]
            if not admitted:
                continue
            lowest = min(r.priority for r in admitted)
            for w in queue:
                if w.priority > lowest and got.get(id(w)) not in (Verdict.ADMITTED, Verdict.CHUNKED, Verdict.DEFERRED):
                    raise fail("admission order", f"{w} (priority {w.priority}) waited while priority {lowest} "
                                                  f"was admitted: {got.get(id(w))}")


def priority_machine(model: str, overlap: bool, mixed: bool = False) -> type[PriorityMachine]:
    REFERENCES.setdefault(model, Reference(model))
    name = f"PriorityMachine{'Overlap' if overlap else 'Plain'}{'Mixed' if mixed else ''}"
    return type(name, (PriorityMachine,), {"OVERLAP": overlap, "MODEL": model, "MIXED": mixed})


@pytest.mark.parametrize("overlap, mixed", [(False, False), (True, False), (True, True)],
                         ids=["plain", "overlap", "mixed"])
def test_priority_deadline_machine(model_dir: str, overlap: bool, mixed: bool) -> None:
    run_state_machine_as_test(priority_machine(model_dir, overlap, mixed), settings=machine_settings())


# ---- scheduler-level cases ----


def _scheduler(model: str, clock: list[float], **kw: Any) -> tuple[Scheduler, QueueReceiver, ListSender]:
    args = ServerArgs.from_kwargs(model_path=model, device="cpu", skip_tokenizer_init=True, context_length=CONTEXT,
                                  random_seed=0, disable_overlap_schedule=True, **kw)
    recv, send = QueueReceiver(), ListSender()
    return Scheduler(args, model, recv, send, clock=lambda: clock[0]), recv, send


def _reasons(send: ListSender) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in send.msgs:
        for rid, reason in zip(m.rids, m.finished_reasons):  # type: ignore[attr-defined]
            if reason is not None:
                out[rid] = reason
    return out


def test_preemption_admits_the_urgent_request(model_dir: str) -> None:
    clock = [0.0]
    s, recv, send = _scheduler(model_dir, clock, schedule_policy="priority", max_running_requests=2)
    long = params(((1,), 60, (), True))
    for rid, prio in (("low-a", 0), ("low-b", -1)):
        recv.q.append(GenerateReqInput(rid, [1, 2, 3], long, priority=prio))
    for _ in range(3):
        s.step()
    assert {r.rid for r in s.decode.running} == {"low-a", "low-b"}
    recv.q.append(GenerateReqInput("urgent", [4, 5], params(((1,), 4, (), True)), priority=5))
    s.step()
    # The least senior of the lower priorities (low-b, priority -1) gave way.
    assert {r.rid for r in s.decode.running} | {r.rid for r in s.prefill.prefilling} >= {"urgent", "low-a"}
    assert [r.rid for r in s.prefill.waiting] == ["low-b"] and s.decode.stats["preemptions"] == 1
    while not s.idle:
        s.step()
    assert all(r["type"] == "length" for r in _reasons(send).values())


def test_fcfs_ignores_priority(model_dir: str) -> None:
    clock = [0.0]
    s, recv, _ = _scheduler(model_dir, clock, max_running_requests=1)
    recv.q.append(GenerateReqInput("first", [1, 2], params(((1,), 30, (), True)), priority=-3))
    s.step()
    recv.q.append(GenerateReqInput("second", [3], params(((1,), 4, (), True)), priority=9))
    s.step()
    assert [r.rid for r in s.decode.running] == ["first"] and s.decode.stats["preemptions"] == 0


def test_deadline_while_compiling(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar request whose compile outlasts its deadline ends when the deadline passes."""
    clock = [0.0]
    s, recv, send = _scheduler(model_dir, clock)
    monkeypatch.setattr(Grammars, "error", lambda self, req: None)
    monkeypatch.setattr(Grammars, "submit", lambda self, req: self.pending.__setitem__(req, True))
    monkeypatch.setattr(Grammars, "ready", lambda self: [])
    monkeypatch.setattr(Grammars, "drop", lambda self, req: self.pending.pop(req, None) is not None)
    sp = params(((1,), 4, (), True))
    sp.regex = "[ab]+"
    recv.q.append(GenerateReqInput("g", [1, 2], sp, timeout=2.0))
    s.step()
    assert s.grammars.pending and "g" in s.rids
    clock[0] = 1.9
    s.step()
    assert "g" in s.rids
    clock[0] = 2.0
    s.step()
    assert _reasons(send)["g"] == {"type": "abort", "message": "deadline: not finished within 2 s"}
    assert not s.grammars.pending and not s.rids and not s.deadlines.reqs


def test_idle_wait_bounded_by_deadline(model_dir: str) -> None:
    clock = [0.0]
    s, _, _ = _scheduler(model_dir, clock)
    assert s.deadlines.next_in() is None
    req = Req("x", [1], params(((1,), 4, (), True)), False, GenerateReqInput("x", [1], params(((1,), 4, (), True)),
                                                                            timeout=0.25))
    s.deadlines.add(req)
    assert s.deadlines.next_in() == 0.25
    t0 = time.monotonic()
    assert s._receive(block=True) == []  # idle: waits at most until the deadline, not IDLE_POLL_S
    assert time.monotonic() - t0 < 0.45
    s.deadlines.discard(req)


# ---- the engine and HTTP paths (null model) ----


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return null_model_dir(tmp_path_factory.mktemp("null-8k"), with_tokenizer=False, context_length=8192)


@pytest.fixture(scope="module")
def served(long_model_dir: str) -> Iterator[ServedApp]:
    engine = BackgroundEngine.start(long_model_dir, load_format="null", skip_tokenizer_init=True,
                                    max_total_tokens=8000, max_running_requests=1, schedule_policy="priority")
    app = ServedApp.start(engine)
    try:
        yield app
    finally:
        app.stop()
        engine.shutdown()


GREEDY = {"temperature": 0.0}


def _run(app: ServedApp, coro: Any) -> Any:
    return app.engine.loop_thread.run(coro)


def test_engine_option_paths(served: ServedApp) -> None:
    e = served.engine.engine
    out = _run(served, e.generate(input_ids=[5, 6], sampling_params={**GREEDY, "max_new_tokens": 3}, priority=4,
                                  timeout=30))
    assert out["output_ids"] == null_continuation(6, 3)
    outs = _run(served, e.generate(input_ids=[[5], [6]], sampling_params={**GREEDY, "max_new_tokens": 2},
                                   priority=[1, -1], timeout=[10.0, 20.0]))
    assert [o["output_ids"] for o in outs] == [null_continuation(5, 2), null_continuation(6, 2)]


@pytest.mark.parametrize("bad,field", [({"priority": "high"}, "priority"), ({"priority": 1.5}, "priority"),
                                       ({"priority": True}, "priority"), ({"priority": 2**63}, "priority"),
                                       ({"timeout": 0}, "timeout"), ({"timeout": -1.0}, "timeout"),
                                       ({"timeout": 86_401}, "timeout"), ({"timeout": "1s"}, "timeout"),
                                       ({"timeout": float("nan")}, "timeout")])
def test_engine_refusals(served: ServedApp, bad: dict[str, Any], field: str) -> None:
    e = served.engine.engine
    with pytest.raises(ValueError, match=field):
        _run(served, e.generate(input_ids=[5], sampling_params={"max_new_tokens": 1}, **bad))


def test_http_paths(served: ServedApp) -> None:
    url = served.url
    r = httpx.post(f"{url}/generate", json={"input_ids": [5, 6], "sampling_params": {**GREEDY, "max_new_tokens": 3},
                                            "priority": 2, "timeout": 30})
    assert r.status_code == 200 and r.json()["output_ids"] == null_continuation(6, 3)
    name = served.model_name
    r = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": [5, 6], "max_tokens": 2, "temperature": 0,
                                                  "priority": -3, "timeout": 10.5})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": name, "input_ids": [5, 6], "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "x"}],
                                                       "priority": 1, "timeout": 10})
    assert r.status_code == 200, r.text
    for path, body in (("/generate", {"input_ids": [5]}), ("/v1/completions", {"model": name, "prompt": [5]})):
        for bad, field in (({"priority": "high"}, "priority"), ({"timeout": 0}, "timeout"),
                           ({"timeout": 1e9}, "timeout")):
            r = httpx.post(f"{url}{path}", json={**body, **bad})
            assert r.status_code == 400 and field in r.text, (path, bad, r.text)


def test_deadlines_waiting_and_running(served: ServedApp) -> None:
    """One request slot: a long request runs past its deadline; one queued behind it
    expires while waiting, with no output."""
    e = served.engine.engine

    async def both() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        chunks: list[dict[str, Any]] = []

        async def running() -> None:
            async for c in e.stream(input_ids=[5], sampling_params={**GREEDY, "max_new_tokens": 7000,
                                                                    "ignore_eos": True}, timeout=1.0):
                chunks.append(c)

        task = asyncio.create_task(running())
        while not chunks and not task.done():
            await asyncio.sleep(0.01)
        waiting = await e.generate(input_ids=[7], sampling_params={**GREEDY, "max_new_tokens": 2}, timeout=0.2,
                                   priority=-1)
        await task
        return chunks, waiting

    chunks, waiting = _run(served, both())
    assert waiting["output_ids"] == []
    assert waiting["meta_info"]["finish_reason"] == {"type": "abort", "message": "deadline: not finished within 0.2 s"}
    fin = chunks[-1]["meta_info"]["finish_reason"]
    assert fin == {"type": "abort", "message": "deadline: not finished within 1 s"}
    got = [t for c in chunks for t in c["output_ids"]]
    assert 0 < len(got) < 7000 and got == null_continuation(5, len(got))
    info = _run(served, e.get_server_info())
    assert info["deadline_aborts"] >= 2


def test_server_default_timeout(long_model_dir: str) -> None:
    with sgl.Engine(long_model_dir, load_format="null", skip_tokenizer_init=True, max_total_tokens=8000,
                    request_timeout=0.3) as e:
        out = e.generate(input_ids=[5], sampling_params={**GREEDY, "max_new_tokens": 7000, "ignore_eos": True})
        assert out["meta_info"]["finish_reason"] == {"type": "abort",
                                                     "message": "deadline: not finished within 0.3 s"}
        out = e.generate(input_ids=[5], sampling_params={**GREEDY, "max_new_tokens": 2}, timeout=60)
        assert out["output_ids"] == null_continuation(5, 2)
    with pytest.raises(ValueError, match="request_timeout"):
        ServerArgs(request_timeout=0)
