"""The whole pipeline over each transport with the null model: exact outputs,
batches, streams, aborts, control calls and KV accounting. No model arithmetic,
so these tests check the roles and the scheduler's bookkeeping alone."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest

import sgl
from sgl.core.protocol import GenerateReqInput
from sgl.runtime.req_options import ReqOptions
from tests.conftest import ENGINE_VARIANTS, null_continuation


@pytest.fixture(scope="module", params=ENGINE_VARIANTS)
def engine(request: pytest.FixtureRequest, null_model_dir: str) -> Iterator[sgl.Engine]:
    e = sgl.Engine(null_model_dir, **request.param, load_format="null", skip_tokenizer_init=True,
                   max_total_tokens=600, max_running_requests=16)
    yield e
    e.shutdown()


GREEDY = {"temperature": 0.0}


def test_single_request_exact(engine: sgl.Engine) -> None:
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 6})
    assert out["output_ids"] == null_continuation(7, 6)
    m = out["meta_info"]
    assert m["prompt_tokens"] == 3 and m["completion_tokens"] == 6
    assert m["finish_reason"] == {"type": "length", "length": 6}
    assert m["e2e_latency"] > 0


def test_batch_keeps_order(engine: sgl.Engine) -> None:
    prompts = [[i, i + 1, i + 2][: 1 + i % 3] for i in range(1, 30)]
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 1 + len(prompts) % 7})
    assert [o["output_ids"] for o in outs] == [null_continuation(p[-1], 1 + len(prompts) % 7) for p in prompts]


@pytest.mark.parametrize(("prompt", "input_ids"), [(None, None), ("hi", [1, 2]), (["hi", "there"], [[1, 2], [3]]),
                                                   (["hi"], [1, 2]), ("hi", [[1, 2]])])
def test_a_call_takes_text_or_ids_never_both(engine: sgl.Engine, prompt: Any, input_ids: Any) -> None:
    """Exactly one of prompt and input_ids, batch or not, for generate and stream; the
    refusal names the field before anything is sent (a batch of texts dropped its ids)."""
    with pytest.raises(ValueError, match=r"^prompt: give exactly one of prompt or input_ids"):
        engine.generate(prompt=prompt, input_ids=input_ids)
    with pytest.raises(ValueError, match=r"^prompt: give exactly one of prompt or input_ids"):
        list(engine.generate(prompt=prompt, input_ids=input_ids, stream=True))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bad", [0, 2, 4])
def test_a_batch_refusal_names_the_prompt(engine: sgl.Engine, bad: int, stream: bool) -> None:
    """A batch whose prompt `bad` holds an id past the vocabulary is refused naming that
    prompt and the id's place in it; the prompts sent beside it are aborted (the accounting
    balances)."""
    prompts: list[list[int]] = [[1, 2, 3] for _ in range(5)]
    prompts[bad] = [4, 5000]
    sp = {**GREEDY, "max_new_tokens": 3}
    with pytest.raises(ValueError, match=rf"^input_ids\[{bad}\]\[1\]=5000 is out of the vocabulary"):
        if stream:
            list(engine.generate(input_ids=prompts, sampling_params=sp, stream=True))
        else:
            engine.generate(input_ids=prompts, sampling_params=sp)


def test_stop_token_and_eos(engine: sgl.Engine) -> None:
    cont = null_continuation(3, 10)
    out = engine.generate(input_ids=[3], sampling_params={**GREEDY, "max_new_tokens": 10, "stop_token_ids": [cont[3]]})
    assert out["output_ids"] == cont[:4]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": cont[3]}
    # 998 -> (998*7+1) % 1000 = 987; find a token whose successor is the eos (999): 857*7+1 = 6000 -> 0; use search
    pre = next(t for t in range(1000) if null_continuation(t, 1)[0] == 999)
    out = engine.generate(input_ids=[pre], sampling_params={**GREEDY, "max_new_tokens": 10})
    assert out["output_ids"] == [999] and out["meta_info"]["finish_reason"]["type"] == "stop"
    out = engine.generate(input_ids=[pre], sampling_params={**GREEDY, "max_new_tokens": 3, "ignore_eos": True})
    assert out["output_ids"] == null_continuation(pre, 3)


def test_stream_deltas_add_up(engine: sgl.Engine) -> None:
    chunks = list(engine.generate(input_ids=[11, 12], sampling_params={**GREEDY, "max_new_tokens": 7}, stream=True))
    assert [t for c in chunks for t in c["output_ids"]] == null_continuation(12, 7)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_max_new_tokens_zero(engine: sgl.Engine) -> None:
    out = engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_abort_running_stream(engine: sgl.Engine) -> None:
    it = engine.generate(input_ids=[4], sampling_params={**GREEDY, "max_new_tokens": 400, "ignore_eos": True},
                         stream=True, rid="to-abort")
    first = next(it)
    assert first["meta_info"]["id"] == "to-abort"
    engine.abort("to-abort")
    rest = list(it)
    assert rest and rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(first["output_ids"]) + sum(len(c["output_ids"]) for c in rest) < 400


def test_leaving_a_stream_early_aborts_it(engine: sgl.Engine) -> None:
    it = engine.generate(input_ids=[4], sampling_params={**GREEDY, "max_new_tokens": 500, "ignore_eos": True},
                         stream=True)
    next(it)
    it.close()


def test_request_too_long_is_an_error_not_a_crash(engine: sgl.Engine) -> None:
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=list(range(600)))
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[1, 5000])
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(input_ids=[1], sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="no_such_field"):
        engine.generate(input_ids=[1], sampling_params={"no_such_field": 1})
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[])
    with pytest.raises(ValueError, match="prompt"):
        engine.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="stop"):
        engine.generate(input_ids=[1], sampling_params={"stop": "needs a tokenizer too"})
    # Fits the context (512) but never the KV pool (600 slots) once others hold it? It fits alone: served.
    out = engine.generate(input_ids=list(range(500)), sampling_params={**GREEDY, "max_new_tokens": 2})
    assert out["output_ids"] == null_continuation(499, 2)


def test_retraction_under_memory_pressure_keeps_outputs_exact(engine: sgl.Engine) -> None:
    # 16 requests x (20 + 60) tokens = 1280 > 600 slots: decode must evict and retract.
    prompts = [[(7 * i + j) % 997 for j in range(20)] for i in range(16)]
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 60, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == [null_continuation(p[-1], 60) for p in prompts]
    assert engine.get_server_info()["retractions"] > 0


def test_async_generate_and_stream(engine: sgl.Engine) -> None:
    async def main() -> None:
        out = await engine.async_generate(input_ids=[8], sampling_params={**GREEDY, "max_new_tokens": 3})
        assert out["output_ids"] == null_continuation(8, 3)
        stream = await engine.async_generate(
            input_ids=[9], sampling_params={**GREEDY, "max_new_tokens": 3}, stream=True
        )
        ids = [t async for c in stream for t in c["output_ids"]]
        assert ids == null_continuation(9, 3)

    asyncio.run(main())


def test_flush_cache_and_health(engine: sgl.Engine) -> None:
    engine.generate(input_ids=[1, 2, 3, 4], sampling_params={**GREEDY, "max_new_tokens": 2})
    assert engine.flush_cache() == {"success": True, "message": ""}
    info = engine.get_server_info()
    assert info["kv_evictable"] == 0 and info["kv_free"] == info["max_total_tokens"]
    # The start's phases, in seconds (no CUDA graphs on CPU: that phase is ~0).
    assert set(info["startup"]) == {"weights_s", "kv_pool_s", "cuda_graphs_s"}
    assert all(0 <= v < 600 for v in info["startup"].values())


def test_penalties_seeds_and_logprobs_survive_retraction(engine: sgl.Engine) -> None:
    """Under memory pressure requests are retracted and re-prefilled: the device-side
    penalty counts, the seeded noise and the logprobs must come out as if each ran alone."""
    prompts = [[(11 * i + j) % 997 for j in range(20)] for i in range(16)]
    params = [{"temperature": 1.0, "seed": i, "max_new_tokens": 60, "ignore_eos": True, "frequency_penalty": 1.5,
               "presence_penalty": 0.5, "repetition_penalty": 1.3} for i in range(16)]
    together = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert engine.get_server_info()["retractions"] > 0
    for p, sp, t in zip(prompts, params, together):
        alone = engine.generate(input_ids=p, sampling_params=sp, return_logprob=True)
        assert t["output_ids"] == alone["output_ids"]
        assert t["meta_info"]["output_token_logprobs"] == alone["meta_info"]["output_token_logprobs"]
    # The penalties bite: far fewer repeats than the same seeds without them.
    free = engine.generate(input_ids=prompts, sampling_params=[{**sp, "frequency_penalty": 0, "presence_penalty": 0,
                                                                 "repetition_penalty": 1.0} for sp in params])
    def repeats(outs: list) -> int:
        return sum(len(o["output_ids"]) - len(set(o["output_ids"])) for o in outs)
    assert repeats(together) < repeats(free)


@pytest.mark.parametrize("ids, params, opts", [
    ([1, 5000], {}, {}),
    (list(range(520)), {}, {}),
    ([1, 2], {"stop_token_ids": [7, 99999]}, {}),
    ([1, 2], {"logit_bias": {"70000": 1.0}}, {}),
    ([1, 2], {"stop": "needs a tokenizer"}, {}),
    ([1, 2], {}, {"return_logprob": True, "logprob_start_len": 2}),
    ([1, 2], {}, {"return_logprob": True, "top_logprobs_num": -1}),
    ([1, 2], {}, {"return_logprob": True, "token_ids_logprob": [3, 60000]}),
], ids=["vocab", "context", "stop_token_ids", "logit_bias", "stop", "logprob_start_len", "top_logprobs_num",
        "token_ids_logprob"])
def test_the_scheduler_aborts_with_the_submit_error(engine: sgl.Engine, ids: list[int], params: dict,
                                                    opts: dict) -> None:
    """A request that skips the tokenizer manager's checks (a foreign client over tcp)
    is refused by the scheduler with the very message submit raises, as the caller's
    ValueError (status_code 400: an HTTP 400)."""
    with pytest.raises(ValueError) as raised:
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, **params}, **opts)

    async def main() -> dict:
        tm = engine._engine.tm
        sp = sgl.SamplingParams.coerce({"max_new_tokens": 2, **params}, {})
        gen = tm._one(tm._submit("unchecked", ids, sp, False, ReqOptions(**opts), None), False)
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    with pytest.raises(ValueError) as refused:
        engine._run(main())
    assert str(refused.value) == str(raised.value)


def test_the_scheduler_rechecks_the_processor_allow_list(engine: sgl.Engine) -> None:
    async def main() -> dict:
        tm = engine._engine.tm
        gen = tm._one(tm._submit("sneaky", [1, 2], sgl.SamplingParams(max_new_tokens=2), False,
                                 ReqOptions(custom_logit_processor="os:system"), None), False)
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    with pytest.raises(ValueError, match="custom_logit_processor='os:system' is not allowed"):
        engine._run(main())


class _Refusing:
    """A sender that cannot carry a generate request (as msgspec refuses a value it cannot encode)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def send(self, msg: Any) -> None:
        if isinstance(msg, GenerateReqInput):
            raise TypeError("Encoding objects of type object is unsupported")
        self.real.send(msg)


def test_a_request_that_cannot_be_sent_leaves_nothing_open(engine: sgl.Engine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tm = engine._engine.tm
    monkeypatch.setattr(tm, "send", _Refusing(tm.send))
    for n in (1, 3):
        with pytest.raises(TypeError):
            engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "n": n}, rid="once")
    monkeypatch.undo()
    assert engine._engine.open_requests == 0
    out = engine.generate(input_ids=[5, 6], sampling_params={**GREEDY, "max_new_tokens": 2}, rid="once")
    assert out["output_ids"] == null_continuation(6, 2)


@pytest.mark.parametrize("call, field", [
    (lambda e: e.generate(input_ids=[5], sampling_params={"max_new_tokens": 1, "stop": "a\ud800"}), "stop"),
    (lambda e: e.generate(input_ids=[5], sampling_params={"max_new_tokens": 1, "custom_params": {"x": 2**70}}),
     "custom_params"),
    (lambda e: e.generate("a\ud800", {"max_new_tokens": 1}), "prompt"),
    (lambda e: e.generate(input_ids=[5], sampling_params={"max_new_tokens": 1}, rid="\ud800"), "rid"),
    (lambda e: e.generate(input_ids=[5], sampling_params={"max_new_tokens": 1, "constraint": {"name": "nope"}}),
     "constraint.name: no trie is kept under 'nope'"),
], ids=["stop", "custom_params", "prompt", "rid", "trie-name"])
def test_what_the_engine_cannot_carry_or_find_is_the_callers_error(engine: sgl.Engine, call: Any,
                                                                  field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        call(engine)
    assert engine._engine.open_requests == 0


def test_the_last_seed_with_n_samples_wraps(engine: sgl.Engine) -> None:
    """Sample i draws with seed + i, wrapped within the seeds' 63 bits: the largest seed
    with n = 2 is two samples, each as a lone request with its seed gives it."""
    top = 2**63 - 1
    outs = engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 4, "seed": top, "n": 2})
    alone = [engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 4, "seed": s}) for s in (top, 0)]
    assert [o["output_ids"] for o in outs] == [a["output_ids"] for a in alone]


def test_a_request_aborted_before_its_prefill_reports_no_prompt_logprobs(engine: sgl.Engine) -> None:
    """Its prompt's logprobs were never computed: none of them, not the first position's
    None alone (a caller gets a prompt's logprobs whole or not at all)."""
    async def main() -> dict:
        e = engine._engine
        await e.pause_generation("in_place")
        try:
            task = asyncio.ensure_future(e.generate(input_ids=list(range(10, 20)), rid="queued",
                                                    sampling_params={"max_new_tokens": 4}, return_logprob=True,
                                                    logprob_start_len=0, top_logprobs_num=2))
            for _ in range(500):  # until the scheduler holds it, queued
                if (await e.get_server_info())["waiting"]:
                    break
                await asyncio.sleep(0.01)
            await e.abort("queued")
            return await task
        finally:
            await e.continue_generation()

    meta = engine._run(main())["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["input_token_logprobs"] == meta["input_top_logprobs"] == meta["output_token_logprobs"] == []


def test_aborting_a_rid_spares_another_whose_rid_extends_it(engine: sgl.Engine) -> None:
    """abort("job") ends the request "job" and, for n > 1, its samples; never a request
    the caller named "job-1" (n > 1 samples' rids take that shape)."""
    async def main() -> tuple[dict, list]:
        e = engine._engine
        await e.pause_generation("in_place")  # they wait in the queue: none can finish meanwhile
        try:
            single = asyncio.ensure_future(e.generate(input_ids=[5, 6], rid="job-1",
                                                      sampling_params={**GREEDY, "max_new_tokens": 30}))
            group = asyncio.ensure_future(e.generate(input_ids=[7, 8], rid="grp",
                                                     sampling_params={**GREEDY, "max_new_tokens": 30, "n": 2}))
            for _ in range(500):  # until the scheduler holds all three
                if (await e.get_server_info())["waiting"] == 3:
                    break
                await asyncio.sleep(0.01)
            await e.abort("job")
            await e.abort("grp")
        finally:
            await e.continue_generation()
        return await single, await group

    single, group = engine._run(main())
    assert single["meta_info"]["finish_reason"]["type"] == "length", single["meta_info"]
    assert single["output_ids"] == null_continuation(6, 30)
    assert [g["meta_info"]["finish_reason"]["type"] for g in group] == ["abort", "abort"]
