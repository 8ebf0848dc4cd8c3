"""sgl.sched.results.Outcomes: each entry's outcome, decided once per step. Through a
real ResultProcessor (its collaborators stand-ins that record), the tokens a grammar
batch's matchers are given (`grammar_tokens`) are exactly the tokens applying the
step appends, for a batch of requests in every state processing tells apart."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.core.sampling_params import SamplingParams
from sgl.sched.req import Req
from sgl.sched.results import Outbox, Outcome, Outcomes, ResultProcessor
from sgl.sched.runner.step import StepResult

STATES = ["decoding", "decoding", "finished", "retracted", "partial", "prefill_only", "abort", "error", "plain",
          "prefill", "eos"]
EOS = 7


def _req(i: int, state: str) -> tuple[Req, int, bool]:
    """A request in `state`, the epoch its batch was launched at, and whether its entry was a middle chunk."""
    r = Req(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=0 if state == "prefill_only" else 8), False)
    r.grammar = None if state == "plain" else object()
    epoch = r.epoch
    if state == "finished":
        r.finished_reason = {"type": "abort", "message": "gone"}
    elif state == "retracted":
        r.epoch += 1
    elif state == "abort":
        r.to_abort = "cancelled"
    return r, epoch, state == "partial"


def _processor(ended: dict[Req, dict[str, Any]]) -> ResultProcessor:
    def finish(req: Req, reason: dict[str, Any]) -> None:
        req.finished_reason = reason
        ended[req] = reason

    kv = SimpleNamespace(cache_unfinished=lambda req: None)
    prefill = SimpleNamespace(remove=lambda req: None)
    decode = SimpleNamespace(add=lambda req: None)
    return ResultProcessor(kv, prefill, decode, None, Outbox(), None, frozenset([EOS]), 64, 1,  # type: ignore[arg-type]
                           finish, lambda req, message: finish(req, {"type": "abort", "message": message}))


@settings(max_examples=60, deadline=None)
@given(states=st.lists(st.sampled_from(STATES), min_size=1, max_size=12), seed=st.integers(10, 1000),
       decode=st.booleans())
def test_the_matchers_get_exactly_the_tokens_applied(states: list[str], seed: int, decode: bool) -> None:
    made = [_req(i, s) for i, s in enumerate(states)]
    reqs = [r for r, _, _ in made]
    is_decode = decode and "partial" not in states
    batch: Any = SimpleNamespace(reqs=reqs, epochs=[e for _, e, _ in made], partial=[p for _, _, p in made],
                                 lp_in=[(0, 0)] * len(reqs), is_decode=is_decode, prefills=lambda i: not is_decode,
                                 unique_reqs=reqs, draft_index=None)
    ids = torch.arange(len(states)) + seed
    for i, s in enumerate(states):
        if s == "eos":
            ids[i] = EOS
    errors = {i: "bad" for i, s in enumerate(states) if s == "error"}
    got = Outcomes(batch, StepResult(ids, errors=errors or None))
    given_ = got.grammar_tokens()
    before = {r: list(r.output_ids) for r in reqs}
    ended: dict[Req, dict[str, Any]] = {}
    _processor(ended).apply(got)
    for r, s in zip(reqs, states):
        appended = r.output_ids[len(before[r]):]
        if r.grammar is not None:
            assert appended == ([given_[r]] if r in given_ else []), (s, appended, given_.get(r))
        assert (got.kinds[reqs.index(r)] is Outcome.TOKEN) == bool(appended), s
    for r, s in zip(reqs, states):
        if s in ("abort", "error"):
            assert ended[r]["type"] == "abort"
        elif s == "eos":
            assert ended[r] == {"type": "stop", "matched": EOS}  # a grammar allows EOS only once complete
        elif s == "prefill_only":
            assert ended[r] == {"type": "length", "length": 0}
        elif s in ("finished", "retracted", "partial"):
            assert r not in ended
