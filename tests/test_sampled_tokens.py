"""sgl.sched.results.sampled_tokens, which the scheduler reads before processing a step
so that grammar matchers take its tokens early (sgl.sched.stepping.EARLY_TOKENS): for a
batch of grammar requests in every state `process` tells apart, it names exactly the
tokens `process` then appends, and no other."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.core.sampling_params import SamplingParams
from sgl.sched.req import Req
from sgl.sched.results import sampled_tokens
from sgl.sched.runner.step import StepResult

STATES = ["decoding", "decoding", "finished", "retracted", "partial", "prefill_only", "abort", "error", "plain"]


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


@settings(max_examples=50, deadline=None)
@given(states=st.lists(st.sampled_from(STATES), min_size=1, max_size=12), seed=st.integers(0, 1000))
def test_it_names_the_tokens_process_appends(states: list[str], seed: int) -> None:
    made = [_req(i, s) for i, s in enumerate(states)]
    batch: Any = SimpleNamespace(reqs=[r for r, _, _ in made], epochs=[e for _, e, _ in made],
                                 partial=[p for _, _, p in made])
    ids = torch.arange(len(states)) + seed
    errors = {i: "bad" for i, s in enumerate(states) if s == "error"}
    got = sampled_tokens(batch, StepResult(ids, errors=errors or None))
    want = {r: int(ids[i]) for i, (r, s) in enumerate(zip(batch.reqs, states)) if s == "decoding"}
    assert got == want
