"""Speculative decoding (NGRAM, and a draft model): proposals, and outputs equal to plain
decoding.

On the default model in float32 an engine with speculative decoding (32-token prefill
chunks; NGRAM also under the overlap loop) and one without serve the same requests: greedy
tokens equal, logprobs within float noise, a seed's samples equal token for token,
finishes (length, stop strings, stop ids, min_new_tokens) equal, grammar, penalty, n > 1
and beam requests in the same batch equal; unseeded samples come from the same
distribution (a permutation test on the first tokens of many samples, with the proposals
accepted and rejected along the way); a stream left early frees its KV. The prompts ask
the model to repeat a text, so the proposals are mostly right and every step kind
(nothing proposed, all taken, a rejection part way) occurs. On the null model with a
device's time, requests regroup when the device is the slower side, on one rank and two."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import sgl
from sgl.core.sampling_params import SamplingParams
from sgl.sched.models.default_model import default_model_dir
from sgl.sched.req import Req
from sgl.sched.speculative import NgramIndex, Speculator
from sgl.testing import DeviceTime, null_model_dir, server_info_when_idle
from sgl.testing.engines import TOKENIZER_VOCAB, null_continuation
from tests.conftest import assert_kv_balanced, tiny_model_dir

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Rivers carry sand to the sea, and the sea gives it back to the shore as beaches.",
    "A list of three colours: red, green and blue; and of three shapes: circle, square and triangle.",
]


def copy_prompt(text: str) -> str:
    return f"Repeat this text exactly:\n{text}\nRepeated text:\n"


PROMPTS = [copy_prompt(t) for t in TEXTS] + ["Name the planets of the solar system."]


def reference_proposal(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The rule, spelled out: the longest suffix (hi down to lo tokens) found earlier,
    ending before the last token; what followed its latest such occurrence."""
    for n in range(min(hi, len(ids) - 1), lo - 1, -1):
        suffix = ids[len(ids) - n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=8),
       st.integers(1, 6), st.integers(1, 4), st.integers(0, 6))
def test_ngram_proposal_is_the_latest_continuation_of_the_longest_suffix(
        prompt: list[int], output: list[int], k: int, lo: int, extra: int) -> None:
    req = Req("r", prompt or [0], SamplingParams(max_new_tokens=64), False)
    index = NgramIndex()
    for j in range(len(output) + 1):  # synced as outputs come, one token at a time
        req.output_ids = output[:j]
        index.sync(req)
        want = reference_proposal(req.all_ids, k, lo, lo + extra)
        assert index.propose(k, lo, lo + extra) == want
        assert index.has_match(lo) == bool(want)  # the one-search check of whether there is any


def test_large_ids_match_only_whole_tokens() -> None:
    # 0x01000000 and 0x00000001 share bytes: a byte match across two tokens is no match.
    req = Req("r", [1, 2**24, 7, 1], SamplingParams(), False)
    index = NgramIndex()
    index.sync(req)
    assert index.propose(3, 1, 1) == [2**24, 7, 1]
    req = Req("r", [2**24 * 5, 1, 9, 2**24], SamplingParams(), False)
    index = NgramIndex()
    index.sync(req)
    assert index.propose(2, 1, 1) == []


def test_proposals_fit_the_output_room_and_the_rows() -> None:
    args = sgl.ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    spec = Speculator(args, 2048)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    reqs = [Req(str(m), ids, SamplingParams(max_new_tokens=m), False) for m in (1, 2, 3, 50)]
    assert [len(p) for p in spec.propose(reqs, 4096, None)[0]] == [0, 1, 2, 4]
    assert [len(p) for p in spec.propose(reqs, 4096, 8)[0]] == [0, 1, 1, 1]  # 8 rows for 4 requests
    assert [len(p) for p in spec.propose(reqs, len(ids) + 3, None)[0]] == [0, 1, 2, 2]  # the context's room
    penalised = Req("p", ids, SamplingParams(max_new_tokens=9, frequency_penalty=0.5), False)
    assert spec.propose([penalised], 4096, None) == ([[]], None)


def test_a_request_in_flight_sits_out_only_to_propose() -> None:
    """Under the overlap loop a request in flight takes a plain row (its tokens on the host
    are a step behind) unless it has something to propose: then it waits for its results.
    After a verify that kept none of its proposals it takes plain steps, 2 then 4 (doubling
    while it misses), before it proposes again; a kept proposal ends the back-off. A draft
    model always has something to propose."""
    args = sgl.ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    spec = Speculator(args, 2048)
    matching = Req("m", [1, 2, 3, 4, 1, 2], SamplingParams(max_new_tokens=50), False)
    fresh = Req("f", [1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=50), False)  # no token seen before
    for r in (matching, fresh):
        r.inflight = 1
    assert spec.waits_for_results(matching, 4096) and not spec.waits_for_results(fresh, 4096)
    assert spec.propose([matching, fresh], 4096, None)[0] == [[], []]  # in flight: plain rows
    last = Req("l", [1, 2, 3, 4, 1, 2], SamplingParams(max_new_tokens=2), False)
    last.inflight = 1
    assert not spec.waits_for_results(last, 4096)  # its in-flight token leaves room for one more: no proposal

    def steps_until_it_proposes() -> int:
        n = 0
        while not spec.propose([matching], 4096, None)[0][0]:
            n += 1
        return n

    matching.inflight = 0
    assert steps_until_it_proposes() == 0
    for wait in (2, 4, 8):
        spec.record(matching, 4, 1)  # none of 4 kept: the sampled token alone
        matching.inflight = 1
        assert not spec.waits_for_results(matching, 4096)  # backing off: plain rows, overlapped
        matching.inflight = 0
        assert steps_until_it_proposes() == wait
    spec.record(matching, 4, 3)  # two kept
    assert steps_until_it_proposes() == 0
    spec.record(matching, 4, 1)
    assert steps_until_it_proposes() == 2  # the back-off starts again from its first length
    assert spec.info()["spec_steps"] == 5 and spec.info()["spec_accepted_tokens"] == 2

    drafted = Speculator(sgl.ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d"), 2048)
    assert drafted.waits_for_results(fresh, 4096)


def test_the_loops_pace_says_when_requests_regroup() -> None:
    """Requests that sit out for their results regroup while the loop waits longer for
    results than it works on the host, by running means of both."""
    spec = Speculator(sgl.ServerArgs(speculative_algorithm="NGRAM"), 2048)
    assert not spec.regroups()
    for _ in range(50):
        spec.pace(host_s=0.002, wait_s=0.001)  # the host is the slower side: steps go on in turns
    assert not spec.regroups()
    turns = 0
    while not spec.regroups() and turns < 50:
        spec.pace(host_s=0.001, wait_s=0.008)
        turns += 1
    assert 1 < turns < 10  # a few turns move it, one does not
    spec.pace(host_s=0.004, wait_s=0.0)  # one slow host turn among them does not
    assert spec.regroups()


def test_under_tensor_parallelism_rank_zeros_pace_decides() -> None:
    """Each rank reads its own clock, yet the ranks' batches must be the same: every rank
    regroups as rank 0's pace says, whatever its own says."""
    from sgl.sched.models.parallel import TPGroup

    votes = {"rank0": 0}

    class TwoRanks(TPGroup):  # min_int over this rank's n and rank 0's vote (rank 0 votes its n)
        def min_int(self, n: int) -> int:
            return n if self.rank == 0 else min(n, votes["rank0"])

    args = sgl.ServerArgs(speculative_algorithm="NGRAM")
    follower, leader = Speculator(args, 2048, TwoRanks(rank=1, size=2)), Speculator(args, 2048, TwoRanks(size=2))
    for spec in (follower, leader):
        for _ in range(50):
            spec.pace(host_s=0.001, wait_s=0.008)  # the device is the slower side here
    assert leader.regroups()
    assert not follower.regroups()  # rank 0 said no
    votes["rank0"] = 1
    assert follower.regroups()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_on_a_slow_device_requests_verify_together(tmp_path: Path, tp_size: int) -> None:
    """On a device slower than the host (a null model whose forwards take 30 ms) under
    the overlap loop, requests with proposals verify in one step each turn rather than in
    groups that take turns, each group every other step. The second pair of requests
    arrives while the first pair decodes, so the two pairs start out of step. Every
    proposal is taken (the prompts hold the null model's continuation), so together the
    first pair gains its tokens in about new / k steps; in turns it took about twice as
    many. Outputs are plain decoding's. Under tensor parallelism (two scheduler processes)
    the ranks regroup together: rank 0's pace decides, and they stay in step to the end."""
    k, new = 5, 100
    prompts = [[x, *null_continuation(x, 200), x] for x in (1000, 1037, 1074, 1111)]
    sp = {"max_new_tokens": new, "ignore_eos": True}
    model = null_model_dir(tmp_path, device_time=DeviceTime(decode_ms=30.0, prefill_ms=30.0, per_token_us=0.0))

    async def main() -> tuple[list[list[int]], dict[str, Any], dict[str, Any]]:
        async with await sgl.AsyncEngine.start(model, load_format="null", tp_size=tp_size,
                                               transport="inproc" if tp_size == 1 else "ipc",
                                               disable_overlap_schedule=False, speculative_algorithm="NGRAM",
                                               speculative_num_draft_tokens=k) as e:
            before = await e.get_server_info()

            async def first(i: int, later: asyncio.Event) -> list[int]:
                ids: list[int] = []
                async for chunk in e.stream(input_ids=prompts[i], sampling_params=sp):
                    ids += chunk["output_ids"]  # a chunk's new ids
                    if len(ids) >= 2 * k:
                        later.set()
                return ids

            async def second(i: int, later: asyncio.Event) -> list[int]:
                await later.wait()
                return (await e.generate(input_ids=prompts[i], sampling_params=sp))["output_ids"]

            later = asyncio.Event()
            outs = await asyncio.gather(first(0, later), first(1, later), second(2, later), second(3, later))
            return list(outs), before, await server_info_when_idle(e)

    outs, before, info = asyncio.run(main())
    assert_kv_balanced(info)
    assert outs == [null_continuation(p[-1], new, TOKENIZER_VOCAB) for p in prompts]
    assert info["spec_regroups"] > before["spec_regroups"]
    # The pairs in turns: about 2 * new / k steps; together, new / k and the few before they met.
    assert info["decode_steps"] - before["decode_steps"] <= new // k + 8


def test_draft_catch_up_stays_within_its_budget() -> None:
    """A draft model's plan: each request catches up on the tokens its draft has not seen
    (from draft_len through its last token) and then proposes; past the step's budget a
    request catches up on what is left of it and proposes in a later step."""
    args = sgl.ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d",
                          speculative_num_draft_tokens=4)
    spec = Speculator(args, 10)
    reqs = [Req(str(i), list(range(100 + i, 106 + i)), SamplingParams(max_new_tokens=50), False) for i in range(3)]
    for r in reqs:
        r.kv_len = 5  # decoding: the prompt's last token is the input
    reqs[1].draft_len = 3
    props, work = spec.propose(reqs, 4096, None)
    assert props == [[-1] * 3, [-1] * 3, []]  # 6 + 3 tokens fit the budget of 10, the third's 6 do not
    assert work == [(0, reqs[0].origin_input_ids), (3, reqs[1].origin_input_ids[3:]), (0, [102])]
    reqs[2].output_ids = [7, 8]
    reqs[2].kv_len, reqs[2].draft_len = 7, 1
    assert spec.propose(reqs[2:], 4096, None) == ([[-1] * 3], [(1, [103, 104, 105, 106, 107, 7, 8])])


def test_accepted_counts_the_matching_prefix() -> None:
    assert Speculator.accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert Speculator.accepted([5, 6, 7], [4, 6, 7, 1]) == 0
    assert Speculator.accepted([5, 6, 7], [5, 6, 7, 1]) == 3
    assert Speculator.accepted([], [3]) == 0


@pytest.fixture(scope="module")
def plain() -> Iterator[sgl.Engine]:
    with sgl.Engine(transport="inproc", random_seed=1) as e:
        yield e


@pytest.fixture(scope="module", params=["NGRAM", "STANDALONE", "NGRAM-overlap"])
def engine(request: pytest.FixtureRequest) -> Iterator[sgl.Engine]:
    """STANDALONE's draft is the target model itself: its greedy proposals are all taken
    (the bookkeeping of the draft's own KV must be right for that), its sampled ones often not.
    NGRAM-overlap runs the overlap loop (a GPU's default; the forward on its own thread here):
    requests in flight sit out to propose, back off after refusals and regroup (the forward
    is the slower side on a CPU), and the outputs stay plain decoding's."""
    algorithm, _, overlap = request.param.partition("-")
    draft = {"speculative_draft_model_path": default_model_dir()} if algorithm == "STANDALONE" else {}
    with sgl.Engine(transport="inproc", random_seed=1, speculative_algorithm=algorithm,
                    speculative_num_draft_tokens=5, chunked_prefill_size=32, disable_overlap_schedule=not overlap,
                    **draft) as e:
        yield e


def _both(plain: sgl.Engine, engine: sgl.Engine, *args: Any, **kw: Any) -> tuple[Any, Any]:
    return plain.generate(*args, **kw), engine.generate(*args, **kw)


def test_greedy_outputs_and_logprobs_equal_plain_decoding(plain: sgl.Engine, engine: sgl.Engine) -> None:
    before = engine.get_server_info()
    sp = {"max_new_tokens": 40, "temperature": 0}
    a, b = _both(plain, engine, PROMPTS, sp, return_logprob=True, top_logprobs_num=2)
    for x, y in zip(a, b):
        assert y["output_ids"] == x["output_ids"]
        assert y["meta_info"]["finish_reason"] == x["meta_info"]["finish_reason"]
        lx, ly = x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in ly] == y["output_ids"]
        assert max(abs(p - q) for (p, _, _), (q, _, _) in zip(lx, ly)) < 1e-3
        assert [[t for _, t, _ in row] for row in y["meta_info"]["output_top_logprobs"]] == \
               [[t for _, t, _ in row] for row in x["meta_info"]["output_top_logprobs"]]
    info = engine.get_server_info()
    steps = info["spec_steps"] + info["spec_plain_steps"] - before["spec_steps"] - before["spec_plain_steps"]
    gained = sum(len(y["output_ids"]) for y in b) - len(b)  # each request's first token came with its prompt
    assert steps < gained  # fewer request steps than tokens: proposals were taken
    assert info["spec_accept_length"] > 1.4
    if info["spec_algorithm"] == "STANDALONE":
        proposed = info["spec_proposed_tokens"] - before["spec_proposed_tokens"]
        assert info["spec_accepted_tokens"] - before["spec_accepted_tokens"] > 0.9 * proposed


def test_seeded_samples_equal_plain_decoding(plain: sgl.Engine, engine: sgl.Engine) -> None:
    """Sampled proposals are often refused, so requests back off and take plain rows, in
    flight, beside others' proposals in the same steps: a seed's tokens all the same."""
    sps = [{"max_new_tokens": 32, "temperature": t, "top_p": 0.95, "seed": s}
           for s, t in zip(range(4), (0.3, 0.7, 1.0, 0.5))]
    before = engine.get_server_info()
    a, b = _both(plain, engine, PROMPTS, sps)
    assert [y["output_ids"] for y in b] == [x["output_ids"] for x in a]
    info = engine.get_server_info()
    assert info["spec_steps"] > before["spec_steps"] and info["spec_plain_steps"] > before["spec_plain_steps"]


FINISHES = [
    {"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 3}, {"max_new_tokens": 7},
    {"max_new_tokens": 32, "stop": [" dog"]}, {"max_new_tokens": 32, "stop": ["sea"], "no_stop_trim": True},
    {"max_new_tokens": 32, "min_new_tokens": 20, "stop": ["."]},
]


def test_finishes_equal_plain_decoding(plain: sgl.Engine, engine: sgl.Engine) -> None:
    """Length at 1, 2, 3 and 7 tokens (the proposals are cut to the room left), stop strings
    ending inside a taken proposal, min_new_tokens: one batch of every pair."""
    prompts = [p for p in PROMPTS[:3] for _ in FINISHES]
    sps = [{**sp, "temperature": 0} for _ in PROMPTS[:3] for sp in FINISHES]
    a, b = _both(plain, engine, prompts, sps)
    for x, y in zip(a, b):
        assert (y["text"], y["output_ids"], y["meta_info"]["finish_reason"]) == \
               (x["text"], x["output_ids"], x["meta_info"]["finish_reason"])


def test_stop_token_ids_and_a_cached_prefix(plain: sgl.Engine, engine: sgl.Engine) -> None:
    base = plain.generate(PROMPTS[0], {"max_new_tokens": 30, "temperature": 0})["output_ids"]
    sp = {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": [base[9]]}
    a, b = _both(plain, engine, PROMPTS[0], sp)
    assert b["output_ids"] == a["output_ids"] == base[:base.index(base[9]) + 1]
    again = engine.generate(PROMPTS[0], sp)
    assert again["output_ids"] == a["output_ids"] and again["meta_info"]["cached_tokens"] > 0


def test_grammar_penalties_n_and_beams_in_one_batch(plain: sgl.Engine, engine: sgl.Engine) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    sps = [{"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)},
           {"max_new_tokens": 40, "temperature": 0, "frequency_penalty": 0.8, "presence_penalty": 0.3},
           {"max_new_tokens": 40, "temperature": 0, "n": 2},
           {"max_new_tokens": 40, "temperature": 0},
           {"max_new_tokens": 16, "temperature": 0, "beam_width": 3}]
    prompts = ["Give a person as JSON.", PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    a, b = _both(plain, engine, prompts, sps)
    assert len(b[2]) == 2 and len(b[4]) == 3  # n=2: its two samples; its three beams

    def ids(outs: list[Any]) -> list[list[int]]:
        return [o["output_ids"] for out in outs for o in (out if isinstance(out, list) else [out])]

    assert ids(b) == ids(a)
    assert json.loads(b[0]["text"]).keys() == {"name", "age"}


def test_grammar_requests_speculate_within_their_grammar(plain: sgl.Engine, engine: sgl.Engine) -> None:
    """JSON-schema and regex requests, greedy and seeded, and a beam search under a
    grammar: the same tokens as plain decoding, valid JSON, and proposals taken (each
    proposal row masked as the matcher would stand after the proposals before it)."""
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    prompts = [f"Put this text in a JSON object under \"text\":\n{t}\nJSON:\n" for t in TEXTS[:2]]
    sps: list[dict[str, Any]] = [{"max_new_tokens": 32, "temperature": 0, "json_schema": json.dumps(schema)}
                                 for _ in prompts]
    sps[1] = {**sps[1], "temperature": 0.7, "seed": 3}
    prompts.append(copy_prompt(TEXTS[0]))
    sps.append({"max_new_tokens": 24, "temperature": 0, "regex": "The quick brown [a-z ]+\\."})
    prompts.append(prompts[0])  # a beam search under a grammar in the same steps: its beams' own matchers
    sps.append({"max_new_tokens": 10, "beam_width": 2, "json_schema": json.dumps(schema)})
    before = engine.get_server_info()
    a, b = _both(plain, engine, prompts, sps)
    assert [[o["output_ids"] for o in y] for y in b[-1:]] == [[o["output_ids"] for o in x] for x in a[-1:]]
    assert [y["output_ids"] for y in b[:-1]] == [x["output_ids"] for x in a[:-1]]
    for y in b[:2]:
        if y["meta_info"]["finish_reason"]["type"] == "stop":
            json.loads(y["text"])
    info = engine.get_server_info()
    assert info["spec_accepted_tokens"] - before["spec_accepted_tokens"] > 12


def test_leaving_a_stream_frees_its_kv(engine: sgl.Engine) -> None:
    stream = engine.generate(PROMPTS[0], {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
                             stream=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            break
    stream.close()  # type: ignore[attr-defined]


def _chi2(a: Counter[int], b: Counter[int]) -> float:
    """Pearson's homogeneity statistic of two samples over their categories."""
    na, nb = sum(a.values()), sum(b.values())
    total = 0.0
    for key in set(a) | set(b):
        k = a[key] + b[key]
        ea, eb = k * na / (na + nb), k * nb / (na + nb)
        total += (a[key] - ea) ** 2 / ea + (b[key] - eb) ** 2 / eb
    return total


def _statistic(a: list[list[int]], b: list[list[int]]) -> float:
    """The chi-square statistics of the tokens at each output position past the first
    (those speculative steps make), summed."""
    return sum(_chi2(Counter(x[j] for x in a), Counter(x[j] for x in b)) for j in range(1, len(a[0])))


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_unseeded_samples_come_from_the_same_distribution(tmp_path_factory: pytest.TempPathFactory,
                                                          algorithm: str) -> None:
    """400 samples of 4 tokens each from a tiny random model over 8 tokens, whose prompt
    gives a proposal at every step (NGRAM; STANDALONE: another tiny random model's most
    likely token), taken a fair share of the time (a quarter; a tenth): the position-wise
    token counts of the two engines, in a permutation test of Pearson's statistic.
    Seeded engines: the same verdict on every run. (Taking a rejected proposal 30% of the
    time, the classic bias toward the draft, fails it for either.)"""
    base = tmp_path_factory.mktemp("spec-tiny")
    model = tiny_model_dir(base, "llama", vocab=8, seed=4, initializer_range=0.2)
    prompt = random.Random(5).choices(range(7), k=24)
    sp = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    speculative: dict[str, Any] = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 4}
    if algorithm == "STANDALONE":  # another tiny random model: its proposals are often unlikely ones
        speculative["speculative_draft_model_path"] = tiny_model_dir(base, "llama", vocab=8, seed=9,
                                                                     initializer_range=0.2)
    outs = []
    for spec in ({}, speculative):
        with sgl.Engine(model, transport="inproc", skip_tokenizer_init=True, dtype="float32", random_seed=1,
                        **spec) as e:
            outs.append([o["output_ids"] for o in e.generate(input_ids=[prompt] * 400, sampling_params=sp)])
            if spec:
                info = e.get_server_info()
                low = 0.15 if algorithm == "NGRAM" else 0.05
                assert low < info["spec_accepted_tokens"] / info["spec_proposed_tokens"] < 0.7
                assert_kv_balanced(info)
    a, b = outs
    observed = _statistic(a, b)
    pool = a + b
    rng = random.Random(0)
    trials = 500
    worse = 0
    for _ in range(trials):
        rng.shuffle(pool)
        worse += _statistic(pool[:400], pool[400:]) >= observed
    assert (worse + 1) / (trials + 1) > 0.01


# ---- a draft model's catch-up ----

def test_a_drafts_short_catch_up_as_decode_rows_equals_one_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft's short catch-ups (a step's bonus token and the proposals it did not feed
    back) run as decode rows, one a token, each attending to the rows before it; the logits
    after each request's last token are those of the same catch-up as one prefill. Each
    catch-up runs both ways on the same state (the prefill first: both write the same KV)."""
    from sgl.sched.runner.draft import DraftModel

    catch_up = DraftModel._catch_up
    seen: list[tuple[list[int], float]] = []

    def both_ways(self: DraftModel, rows: list[int], works: list[Any], ends: list[int]) -> Any:
        lens = [len(w.tokens) for w in works]
        if max(lens) > self.catch_up_rows:
            return catch_up(self, rows, works, ends)
        keep, self.catch_up_rows = self.catch_up_rows, 0
        one_prefill = catch_up(self, rows, works, ends).clone()
        self.catch_up_rows = keep
        out = catch_up(self, rows, works, ends)
        seen.append((lens, float((out - one_prefill).abs().max())))
        return out

    monkeypatch.setattr(DraftModel, "_catch_up", both_ways)
    with sgl.Engine(transport="inproc", random_seed=1, speculative_algorithm="STANDALONE",
                    speculative_num_draft_tokens=5, speculative_draft_model_path=default_model_dir()) as e:
        outs = e.generate(PROMPTS, {"max_new_tokens": 40, "temperature": 0})
        assert all(len(o["output_ids"]) == 40 for o in outs)
    assert any(max(lens) > 1 for lens, _ in seen)  # rows of one request that attend to each other
    assert any(len(lens) > 1 for lens, _ in seen)  # several requests in one catch-up
    assert max(d for _, d in seen) < 1e-3


# ---- a draft model's arguments and memory ----

def test_draft_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        sgl.ServerArgs(speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="speculative_draft_model_path is invalid without"):
        sgl.ServerArgs(speculative_algorithm="NGRAM", speculative_draft_model_path="d")
    with pytest.raises(ValueError, match="invalid with tp_size > 1"):
        sgl.ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d", tp_size=2,
                       transport="ipc")


def test_draft_model_memory_goes_with_the_targets(tmp_path_factory: pytest.TempPathFactory,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing draft, or one whose context is shorter than the engine's (its positions
    would run past its rotary table), fails the start with what to pass. Releasing
    weights or the KV cache releases the draft's too; a holder that fails leaves every
    holder of the tag as it was."""
    from sgl.sched.runner.model_runner import ModelRunner

    base = tmp_path_factory.mktemp("spec-memory")
    target = tiny_model_dir(base, "llama", vocab=8, seed=4)
    with pytest.raises(ValueError, match="is not a directory"):
        ModelRunner(sgl.ServerArgs(speculative_algorithm="STANDALONE", max_total_tokens=64,
                                   speculative_draft_model_path=str(base / "missing")), target)
    short = tiny_model_dir(base, "llama", vocab=8, seed=7, max_position_embeddings=256)
    with pytest.raises(ValueError, match=r"draft model's context \(256 tokens\) is shorter than context_length"):
        ModelRunner(sgl.ServerArgs(speculative_algorithm="STANDALONE", max_total_tokens=64,
                                   speculative_draft_model_path=short), target)
    r = ModelRunner(sgl.ServerArgs(speculative_algorithm="STANDALONE", max_total_tokens=64,
                                   speculative_draft_model_path=tiny_model_dir(base, "llama", vocab=8, seed=9)),
                    target)
    try:
        draft = r.draft
        assert draft is not None and draft.kv_pool.size == r.kv_pool.size == 64
        r.release_memory({"weights", "kv_cache"})
        assert draft.kv_pool.released and not draft.weights.resident
        assert all(p.numel() == 0 for p in draft.model.parameters())  # type: ignore[attr-defined]
        r.resume_memory({"weights", "kv_cache"})
        assert r.released == frozenset() and not draft.kv_pool.released and draft.weights.resident

        def broken() -> None:
            raise RuntimeError("out of memory")

        monkeypatch.setattr(draft.weights, "release", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            r.release_memory({"weights"})
        assert r.released == frozenset() and r.weights.resident  # the target's release was undone
        r.release_memory({"kv_cache"})
        monkeypatch.setattr(draft.kv_pool, "resume", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            r.resume_memory({"kv_cache"})
        assert r.released == {"kv_cache"} and r.kv_pool.released  # the target's resume was undone
    finally:
        r.close()


@pytest.fixture(scope="module")
def small_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from sgl.sched.runner.model_runner import ModelRunner

    base = tmp_path_factory.mktemp("decode-steps")
    r = ModelRunner(sgl.ServerArgs(max_total_tokens=256, max_running_requests=8, context_length=64),
                    tiny_model_dir(base, "llama", vocab=8, seed=4))
    yield r
    r.close()


@given(st.data())
def test_guess_forwards_planned_together_get_each_forwards_own_metadata(small_runner: Any,
                                                                        data: st.DataObject) -> None:
    """A draft's guess forwards planned in one go (one upload, one gather of every forward's
    KV slots) get the attention metadata each forward would get planned alone."""
    import torch

    from sgl.core.host_copy import Uploads

    r = small_runner
    pool = r.req_to_token_pool
    n_rows, ctx = min(pool.req_to_token.shape[0], 8), min(pool.req_to_token.shape[1], 64)
    for row in range(n_rows):  # each row's slots: any ids of the KV pool
        pool.write(row, 0, torch.tensor(data.draw(st.lists(st.integers(1, 255), min_size=ctx, max_size=ctx))))
    pool.sync()
    forwards = data.draw(st.lists(st.lists(st.tuples(st.integers(0, n_rows - 1), st.integers(1, ctx)),
                                           min_size=1, max_size=6), max_size=4))
    rows = [[row for row, _ in f] for f in forwards]
    kv_lens = [[k for _, k in f] for f in forwards]
    together = r.preparer.decode_steps(rows, kv_lens, Uploads(r.device))
    assert len(together) == len(forwards)
    for rs, ks, meta in zip(rows, kv_lens, together):
        alone = r.preparer.attention(True, [1] * len(rs), ks, torch.tensor(rs))
        assert meta.is_decode and meta.qo_lens == alone.qo_lens and meta.kv_lens == alone.kv_lens
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "qo_indptr_host", "kv_indptr_host"):
            assert torch.equal(getattr(meta, name), getattr(alone, name)), name
