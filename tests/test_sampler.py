"""The sampler alone, on fixed logits over a small vocabulary: temperature, top-k,
top-p and min-p draw from the distribution they promise (thousands of seeded
draws in one batch, tolerant bounds); bias, penalties and the min_new_tokens
mask equal a plain per-row reference; seeded rows ignore their neighbours; and
SamplingParams validation names the field and the range."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.core.sampling_params import SamplingParams
from sgl.sched.req import Req
from sgl.sched.runner.sampler import SamplingBatch, process_logits, sample

V = 6
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
DRAWS = 20000


def _reqs(n: int, **params: Any) -> list[Req]:
    return [Req(str(i), [1], SamplingParams(**params), False) for i in range(n)]


def _frequencies(**params: Any) -> torch.Tensor:
    reqs = _reqs(DRAWS, **params)
    sb = SamplingBatch.from_reqs(reqs, V, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1234)
    ids = sample(LOGITS.repeat(DRAWS, 1), sb, gen)
    return torch.bincount(ids, minlength=V).double() / DRAWS


def _assert_close(freq: torch.Tensor, expected: torch.Tensor) -> None:
    # 5 standard errors per cell: a false alarm is vanishingly rare, and the seed is fixed anyway.
    tol = 5 * torch.sqrt(expected * (1 - expected) / DRAWS) + 1e-9
    assert ((freq - expected).abs() <= tol).all(), (freq, expected)
    assert freq[expected == 0].sum() == 0, (freq, expected)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature: float) -> None:
    _assert_close(_frequencies(temperature=temperature), torch.softmax(LOGITS.double() / temperature, -1))


@pytest.mark.parametrize("temperature", [0.0, 1e-39, 9.9e-6])
def test_temperature_zero_is_argmax(temperature: float) -> None:
    """Under 1e-5 a temperature is greedy (as in SGLang and vLLM): dividing the logits by
    1e-39 overflowed float32 into NaN probabilities, and every draw took the last id."""
    assert (_frequencies(temperature=temperature) == torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=torch.double)).all()


@pytest.mark.parametrize("top_p", [1e-300, 1e-44])
def test_a_top_p_under_float32s_range_keeps_the_likeliest(top_p: float) -> None:
    """1e-300 rounds to 0 in float32, which kept no token at all (every draw took id 0,
    whatever its probability)."""
    reqs = _reqs(200, top_p=top_p)
    sb = SamplingBatch.from_reqs(reqs, V, torch.device("cpu"))
    rev = LOGITS.flip(0).repeat(200, 1)  # the likeliest id is the last: id 0 is the least likely
    assert (sample(rev, sb, torch.Generator().manual_seed(3)) == V - 1).all()


@pytest.mark.parametrize("bias,never", [(1e9, None), (-1e9, 0)])
def test_the_largest_bias_forces_or_bans_its_token_at_any_temperature(bias: float, never: int | None) -> None:
    """A bias at the bound, added to float32 logits and divided by the least sampled
    temperature, stays finite: the biased token is drawn every time, or never."""
    token = 3 if never is None else never
    reqs = _reqs(1000, temperature=1e-5, logit_bias={token: bias})
    sb = SamplingBatch.from_reqs(reqs, V, torch.device("cpu"))
    ids = sample(process_logits(LOGITS.repeat(1000, 1), sb, None), sb, torch.Generator().manual_seed(1))
    assert ((ids == token) if never is None else (ids != token)).all(), ids.bincount(minlength=V)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k(k: int) -> None:
    p = torch.softmax(LOGITS.double(), -1)
    p[k:] = 0
    _assert_close(_frequencies(top_k=k), p / p.sum())


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p(top_p: float) -> None:
    p = torch.softmax(LOGITS.double(), -1)
    keep, mass = [], 0.0
    for q in p.tolist():  # the smallest prefix (sorted descending) whose mass reaches top_p
        keep.append(mass < top_p)
        mass += q
    p[~torch.tensor(keep)] = 0
    _assert_close(_frequencies(top_p=top_p), p / p.sum())


@pytest.mark.parametrize("min_p", [0.2, 0.5])
def test_min_p(min_p: float) -> None:
    p = torch.softmax(LOGITS.double(), -1)
    p[p < min_p * p.max()] = 0
    _assert_close(_frequencies(min_p=min_p), p / p.sum())


def test_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    def run(batch: list[Req]) -> list[int]:
        sb = SamplingBatch.from_reqs(batch, V, torch.device("cpu"))
        out = [sample(LOGITS.repeat(len(batch), 1), sb, torch.Generator().manual_seed(s)).tolist() for s in range(20)]
        return [o[[r.rid for r in batch].index("seeded")] for o in out]

    seeded = Req("seeded", [1], SamplingParams(seed=7), False)
    alone = run([seeded])
    mixed = run([*_reqs(3, temperature=2.0), Req("seeded", [1], SamplingParams(seed=7), False), *_reqs(2)])
    assert alone == mixed
    assert len(set(alone)) > 1  # it did sample


@settings(max_examples=60, deadline=None)
@given(vocab=st.sampled_from([2, 7, 151_936]), data=st.data())
def test_a_draw_never_takes_a_token_of_probability_zero(vocab: int, data: st.DataObject) -> None:
    """Whatever the support (a lone first or last id, scattered ids, ids at the edges of
    a vocabulary as large as Qwen's) and whatever the uniforms, every drawn id has p > 0,
    and a row's draw with a seed is the same on its own as beside others."""
    rows = data.draw(st.integers(1, 6))
    ids = st.integers(0, vocab - 1)
    supports = [data.draw(st.one_of(st.sets(ids, min_size=1, max_size=5), st.just({0}), st.just({vocab - 1})))
                for _ in range(rows)]
    logits = torch.full((rows, vocab), -math.inf)
    for i, allowed in enumerate(supports):
        for t in allowed:
            logits[i, t] = data.draw(st.floats(-30, 30))
    reqs = [Req(str(i), [1], SamplingParams(temperature=data.draw(st.sampled_from([0.3, 1.0, 4.0])),
                                             seed=data.draw(st.one_of(st.none(), st.integers(0, 99)))), False)
            for i in range(rows)]
    sb = SamplingBatch.from_reqs(reqs, vocab, torch.device("cpu"))
    got = sample(logits.clone(), sb, torch.Generator().manual_seed(data.draw(st.integers(0, 2**32))))
    assert all(int(t) in allowed for t, allowed in zip(got, supports)), (got, supports)
    for i, r in enumerate(reqs):
        if r.sampling_params.seed is not None:
            alone = SamplingBatch.from_reqs([r], vocab, torch.device("cpu"))
            assert int(sample(logits[i:i + 1].clone(), alone, torch.Generator())[0]) == int(got[i])


def _reference(logits: torch.Tensor, reqs: list[Req], eos: set[int]) -> torch.Tensor:
    """One row at a time, one token at a time: the textbook definitions."""
    out = logits.clone()
    for i, r in enumerate(reqs):
        p = r.sampling_params
        for t, b in p.logit_bias.items():
            out[i, t] += b
        counts: dict[int, int] = {}
        for t in r.output_ids:
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            x = out[i, t].item()
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            out[i, t] = x - p.frequency_penalty * c - p.presence_penalty
        if len(r.output_ids) < p.min_new_tokens:
            for t in [*p.stop_token_ids, *([] if p.ignore_eos else eos)]:
                out[i, t] = -math.inf
    return out


def test_bias_penalties_and_min_new_tokens_equal_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    v = 50
    params = [
        dict(frequency_penalty=0.5),
        dict(presence_penalty=-1.2, logit_bias={3: 2.5, 7: -100.0}),
        dict(repetition_penalty=1.7, frequency_penalty=-0.3, presence_penalty=0.4),
        dict(repetition_penalty=0.6, logit_bias={"0": 1.0}),
        dict(min_new_tokens=10, stop_token_ids=[5, 6]),
        dict(min_new_tokens=10, ignore_eos=True, stop_token_ids=[8]),
        dict(),
    ]
    reqs = []
    for i, p in enumerate(params):
        r = Req(str(i), [1], SamplingParams.coerce(p), False)
        r.output_ids = torch.randint(0, 12, (int(torch.randint(0, 15, (1,), generator=g)),), generator=g).tolist()
        reqs.append(r)
    logits = torch.randn(len(reqs), v, generator=g) * 3
    counts = torch.zeros(len(reqs), v, dtype=torch.int32)
    for i, r in enumerate(reqs):
        for t in r.output_ids:
            counts[i, t] += 1
    sb = SamplingBatch.from_reqs(reqs, v, torch.device("cpu"), frozenset({49}))
    got = process_logits(logits, sb, counts)
    want = _reference(logits, reqs, {49})
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=1e-6, atol=1e-5)
    assert not torch.equal(got, logits)  # something applied, and the input is left alone
    assert torch.equal(logits, logits.clone())


@pytest.mark.parametrize("field,value,allowed", [
    ("temperature", -0.1, ">= 0"), ("top_p", 0.0, "(0, 1]"), ("top_k", 0, "-1"), ("min_p", 1.5, "[0, 1]"),
    ("frequency_penalty", 2.5, "[-2, 2]"), ("presence_penalty", -3, "[-2, 2]"), ("repetition_penalty", 0, "(0, 2]"),
    ("repetition_penalty", 2.1, "(0, 2]"), ("n", 0, "in [1, 128]"), ("n", 129, "in [1, 128]"),
    ("seed", 2**64, "64-bit"), ("top_k", 2**64, "64-bit"), ("stop", ["a"] * 65, "at most 64"),
    ("stop", ["a" * 513], "at most 512"), ("max_new_tokens", -1, ">= 0"),
    ("min_new_tokens", 200, "max_new_tokens"), ("stop", [""], "non-empty"), ("stop_token_ids", [-1], "non-negative"),
    ("logit_bias", {"1": math.inf}, "[-1e+09, 1e+09]"), ("logit_bias", {"1": -1e308}, "[-1e+09, 1e+09]"),
    ("stop", ["a\ud800"], "Unicode"), ("stop_regex", "\udfff", "Unicode"), ("regex", "a\ud800", "Unicode"),
    ("custom_params", {"x": object()}, "what JSON carries"), ("custom_params", {"x": 2**70}, "what JSON carries"),
])
def test_validation_names_the_field_and_range(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams.coerce({field: value})
    assert allowed in str(e.value)


def test_unknown_fields_and_defaults() -> None:
    with pytest.raises(ValueError, match="beam"):
        SamplingParams.coerce({"beam": 2})
    p = SamplingParams.coerce({"top_p": 0.5, "stop": "x"}, defaults={"top_p": 0.9, "top_k": 20, "temperature": 0.3})
    assert (p.top_p, p.top_k, p.temperature, p.stop) == (0.5, 20, 0.3, ["x"])
    assert SamplingParams.coerce({"logit_bias": {"12": 1}}).logit_bias == {12: 1.0}


def _fields(sb: SamplingBatch) -> list[Any]:
    """Every field, tensors as lists and generators as their state, for comparison."""
    out: list[Any] = []
    for name in SamplingBatch.__slots__:  # type: ignore[attr-defined]
        v = getattr(sb, name)
        if name == "generators":
            out.append([None if g is None else g.get_state().tolist() for g in v])
        elif isinstance(v, torch.Tensor):
            out.append(v.tolist())
        elif isinstance(v, tuple):
            out.append([t.tolist() for t in v])
        else:
            out.append(v)
    return out


def test_a_decode_step_reusing_the_last_batch_equals_a_fresh_build() -> None:
    """The model runner rebuilds a decode step's SamplingBatch from the previous step's
    for the same requests: over steps in which tokens accrue (seeded draws move on,
    min_new_tokens bans lift), that equals building it from scratch each step."""
    params = [dict(temperature=0.7, seed=3, top_k=3), dict(), dict(min_new_tokens=2, stop_token_ids=[4]),
              dict(top_p=0.5, min_p=0.1, seed=9, logit_bias={"2": 1.0}), dict(repetition_penalty=1.3, temperature=1.2)]
    reqs = [Req(str(i), [1], SamplingParams.coerce(p), False) for i, p in enumerate(params)]
    prev = None
    for step in range(4):
        fresh = SamplingBatch.from_reqs(reqs, V, torch.device("cpu"), frozenset({5}), decode_from=0)
        reused = SamplingBatch.from_reqs(reqs, V, torch.device("cpu"), frozenset({5}), decode_from=0, same_as=prev)
        assert _fields(reused) == _fields(fresh), step
        assert (reused.ban is not None) == (step < 2)  # the ban lifts once two tokens are out
        prev = reused
        for r in reqs:
            r.output_ids.append(step)
