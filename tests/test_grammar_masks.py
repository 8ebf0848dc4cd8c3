"""The grammar bitmasks of one step (sgl.sched.runner.grammar_masks), on the default
model's tokenizer and a JSON schema: each row's mask equals the one a lone matcher
makes after taking the same tokens, whatever the rows are (ended requests, refused
tokens, an EOS that completes the grammar, several tokens since the last mask), with
the step's tokens in output_ids or given apart (sampled, not yet processed), with
xgrammar's fill on one native thread or several, on the fill thread or here; and
`accept_all`'s answers, through xgrammar's internals or its wrapper."""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
KINDS = st.sampled_from(["ok", "ok", "ok", "two", "refused", "ended", "eos", "fresh"])


@functools.cache
def _grammar() -> tuple[Any, int, int]:
    """The compiled schema, the masks' width, and EOS."""
    from transformers import AutoTokenizer

    from sgl.sched.grammar import _compiler_for
    from sgl.sched.models.default_model import default_model_dir

    path = default_model_dir()
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    compiler, width = _compiler_for(path, False, 1 << 20, (eos,))
    return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False), width, eos


@functools.cache
def _whole() -> list[int]:
    """An output the schema takes whole: EOS may follow it."""
    from transformers import AutoTokenizer

    from sgl.sched.models.default_model import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir()).encode('{"name": "ab", "n": 7}', add_special_tokens=False)


def _allowed(m: Any, width: int) -> set[int]:
    import xgrammar

    from benchmarks.common import allowed_ids

    bits = xgrammar.allocate_token_bitmask(1, width)
    m.fill_next_token_bitmask(bits, 0)
    return set(allowed_ids(bits[0].numpy(), width).tolist())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(KINDS, min_size=1, max_size=40), threads=st.sampled_from([1, 3, 8]),
       background=st.booleans(), early=st.booleans(), seed=st.integers(0, 2**16))
def test_each_rows_mask_is_a_lone_matchers(kinds: list[str], threads: int, background: bool, early: bool,
                                           seed: int) -> None:
    from unittest import mock

    import xgrammar

    from sgl.core.sampling_params import SamplingParams
    from sgl.sched.req import Req
    from sgl.sched.runner.grammar_masks import GrammarRows, MaskFiller

    compiled, width, eos = _grammar()
    whole = _whole()
    rng = random.Random(seed)
    reqs, refs = [], []  # each row's request and a lone matcher taking the same tokens (None: no mask to compare)
    for i, kind in enumerate(kinds):
        r = Req(f"r{i}", [1, 2], SamplingParams(max_new_tokens=64), False)
        r.grammar, ref = xgrammar.GrammarMatcher(compiled), xgrammar.GrammarMatcher(compiled)
        # A random point of the output, taken before this step; an "eos" row's output is whole.
        for k in range(len(whole) if kind == "eos" else rng.randrange(8)):
            t = whole[k] if kind == "eos" else rng.choice(sorted(_allowed(ref, width) - {eos}) or [eos])
            if t == eos:
                break
            assert r.grammar.accept_token(t) and ref.accept_token(t)
            r.output_ids.append(t)
        r.grammar_seen = len(r.output_ids)
        allowed = _allowed(ref, width)
        plain = sorted(allowed - {eos})
        if kind == "ended":
            r.finished_reason = {"type": "abort", "message": "gone"}
            ref = None
        elif kind == "refused":
            r.output_ids.append(next(t for t in range(width) if t not in allowed))
            ref = None
        elif kind == "eos":
            assert eos in allowed
            r.output_ids.append(eos)
            ref = None  # the grammar is complete: the request ends with this token
        elif kind == "two" and plain:  # a step it sat out: two tokens since its last mask
            first = rng.choice(plain)
            ref.accept_token(first)
            second = rng.choice(sorted(_allowed(ref, width) - {eos}) or [eos])
            if second == eos:
                ref.accept_token(eos)
                ref = None
            else:
                ref.accept_token(second)
            r.output_ids += [first, second]
        elif kind != "fresh" and plain:
            t = rng.choice(plain)
            ref.accept_token(t)
            r.output_ids.append(t)
        reqs.append(r)
        refs.append(ref)
    rows = GrammarRows(None, None, [10 + i for i in range(len(reqs))], reqs, [0] * len(reqs), width)
    # early: the step's tokens given as sampled, not yet in output_ids (as the scheduler
    # gives them: sgl.sched.results.Outcomes.grammar_tokens), and appended after the start.
    just = {r: r.output_ids.pop() for r in reqs
            if early and r.finished_reason is None and len(r.output_ids) > r.grammar_seen}
    filler = MaskFiller(torch.device("cpu"), frozenset([eos]))
    filler.threads = threads  # xgrammar's fill threads do not need cores of their own to be right
    try:
        with mock.patch("sgl.sched.runner.grammar_masks.CHUNK_MIN", 4):  # small batches take the threads too
            started = filler.start(rows, just or None, background=background)
            for r, t in just.items():
                r.output_ids.append(t)
            got = filler.finish(started)
    finally:
        filler.close()
    for j, (kind, ref) in enumerate(zip(kinds, refs)):
        if ref is None:
            assert (got.mask[j] == -1).all(), (j, kind)  # all allowed: the request ends
            assert (10 + j in got.errors) == (kind == "refused")
            continue
        assert 10 + j not in got.errors
        want = xgrammar.allocate_token_bitmask(1, width)
        ref.fill_next_token_bitmask(want, 0)
        assert torch.equal(got.mask[j], want[0]), (j, kind)
        assert reqs[j].grammar_seen == len(reqs[j].output_ids)



@pytest.mark.parametrize("internals", [True, False])
def test_accept_all_says_which_tokens_were_refused(monkeypatch: Any, internals: bool) -> None:
    """`accept_all`: None when every matcher took its token; else each one's answer, the
    refused matcher left where it was. The same through xgrammar's own wrapper when its
    internals are not where `accept_all` reads them."""
    import xgrammar
    import xgrammar.base

    from sgl.sched.runner.grammar_masks import accept_all

    if not internals:
        monkeypatch.delattr(xgrammar.base, "_core")
    compiled, width, eos = _grammar()
    ms = [xgrammar.GrammarMatcher(compiled) for _ in range(5)]
    ok = sorted(_allowed(ms[0], width) - {eos})[0]
    bad = next(t for t in range(width) if t not in _allowed(ms[0], width))
    assert accept_all(ms[:3], [ok] * 3) is None
    before = _allowed(ms[4], width)
    assert accept_all(ms[3:], [ok, bad]) == [True, False]
    assert _allowed(ms[4], width) == before
