"""sgl.testing.contract against real engines. Over requests drawn by
sgl.testing.strategies, every result and stream (each stream joined against the same
request's result) keeps the contract on the null model and on the default model
(SmolLM2, float32, CPU, with its tokenizer's decode for the exact-text rule), and on
FakeEngine (its built-in tokenizer), and nothing leaks after each. Engines wrapped to
break one rule on the way out (a stop string left in, a sample dropped, a chunk sent twice, a finish reason dropped, a
stream abandoned without its abort) are caught by the rule's id, and every rule in
RULES is tripped by a result or server info broken on purpose."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

import sgl
from sgl.testing.contract import (
    RULES,
    Contract,
    ContractViolation,
    EngineFacts,
    assert_engine_clean,
    assert_no_leaks,
    tokenizer_decoder,
)
from sgl.testing.strategies import GenerateRequest, InvalidRequest, Limits, generate_requests, invalid_requests
from tests.conftest import assert_kv_balanced
from tests.hypothesis_profiles import PROFILE


class Driven:
    """An AsyncEngine used from synchronous tests (Hypothesis's) on a loop of its own,
    with the contract for its facts and the limits of requests drawn for it."""

    def __init__(self, engine: sgl.AsyncEngine, has_tokenizer: bool, **sizes: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        info = self.get_server_info()
        decode = tokenizer_decoder(engine.tokenizer) if has_tokenizer else None
        self.contract = Contract(EngineFacts.from_server_info(info, has_tokenizer=has_tokenizer, decode=decode))
        self.limits = Limits.from_server_info(info, has_tokenizer=has_tokenizer, **sizes)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def get_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.run(self.engine.get_server_info())
        return info

    def check_round_trip(self, request: GenerateRequest) -> None:
        """The request's result keeps the contract; streamed (where it can be), its chunks
        do and join to that result; then nothing is left behind."""
        plain = request.streamed(False)
        result = self.run(plain.run(self.engine))
        self.contract.check_result(plain, result)
        if not any(item.is_beam for item in plain.items()):
            chunks = self.run(plain.streamed().run(self.engine))
            self.contract.check_stream(plain.streamed(), chunks, result)
        self.run(assert_engine_clean(self.engine))

    def close(self) -> None:
        self.run(self.engine.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def null(null_model_dir: str) -> Iterator[Driven]:
    d = Driven(sgl.AsyncEngine(null_model_dir, transport="inproc", load_format="null", skip_tokenizer_init=True,
                               max_total_tokens=2000, max_running_requests=16), has_tokenizer=False)
    yield d
    d.close()


@pytest.fixture(scope="module")
def smol() -> Iterator[Driven]:
    # Small requests: the CPU decodes ~100 tokens/s.
    d = Driven(sgl.AsyncEngine(transport="inproc", dtype="float32", max_total_tokens=4000), has_tokenizer=True,
               max_new_tokens=6, max_batch=2, max_n=2, max_beam_width=2, grammars=False)
    yield d
    d.close()


def fake_answer(prompt: Any, params: Any) -> str:
    """Text that varies with the request (stop strings and lengths meet it differently)."""
    words = ["the", "quick", "brown", "fox", ",", "1", "2", "3", ".", "ok", "\n", "jumps", "over"]
    key = sum(prompt) if isinstance(prompt, list) else len(prompt or "")
    return " ".join(words[(key + i * 7) % len(words)] for i in range(12))


@pytest.fixture(scope="module")
def fake() -> Iterator[Driven]:
    from sgl.testing.fake import FakeEngine

    d = Driven(FakeEngine(fake_answer, max_total_tokens=4000), has_tokenizer=True,  # type: ignore[arg-type]
               max_new_tokens=16, grammars=False)
    yield d
    d.close()


@pytest.fixture(autouse=True)
def nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("null", "smol", "fake"):
        if name in request.fixturenames:
            d: Driven = request.getfixturevalue(name)
            assert_kv_balanced(d.run(assert_engine_clean(d.engine)))


# Each example runs a real engine: settings per test scale the profile's count down.
def engine_settings(share: int) -> settings:
    return settings(PROFILE, max_examples=max(PROFILE.max_examples // share, 2),
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_the_contract_holds_on_the_null_model(null: Driven) -> None:
    @engine_settings(4)
    @given(generate_requests(null.limits))
    def run(request: GenerateRequest) -> None:
        null.check_round_trip(request)

    run()


def test_the_contract_holds_on_the_default_model(smol: Driven) -> None:
    @engine_settings(20)
    @given(generate_requests(smol.limits))
    def run(request: GenerateRequest) -> None:
        smol.check_round_trip(request)

    run()


def test_the_contract_holds_on_the_fake_engine(fake: Driven) -> None:
    @engine_settings(2)
    @given(generate_requests(fake.limits))
    def run(request: GenerateRequest) -> None:
        fake.check_round_trip(request)

    run()


def test_invalid_requests_raise_the_engines_value_error_naming_the_field(null: Driven) -> None:
    @engine_settings(4)
    @given(invalid_requests(null.limits))
    def run(bad: InvalidRequest) -> None:
        with pytest.raises(ValueError) as e:
            null.run(bad.request.run(null.engine))
        assert re.search(rf"(?<![\w]){re.escape(bad.field)}(?![\w])", str(e.value)), (bad.field, str(e.value))

    run()


COUNT = "Count from one to twenty: 1, 2, 3,"  # SmolLM2 goes on " 4, 5, 6, ...": a comma every few tokens


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_stop_strings_keep_the_contract_on_the_default_model(smol: Driven, no_stop_trim: bool) -> None:
    request = GenerateRequest(prompt=COUNT, sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": [",", "7"],
                                                             "no_stop_trim": no_stop_trim})
    result = smol.run(request.run(smol.engine))
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}  # the rule had work to do
    smol.contract.check_result(request, result)
    smol.contract.check_stream(request.streamed(), smol.run(request.streamed().run(smol.engine)), result)


GRAMMARS = [
    {"json_schema": json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                                 "ok": {"type": "boolean"}},
                                "required": ["city", "ok"], "additionalProperties": False})},
    {"regex": "(yes|no), [0-9]{2}"},
]


@pytest.mark.parametrize("grammar", GRAMMARS, ids=["json_schema", "regex"])
def test_grammar_outputs_keep_the_contract_on_the_default_model(smol: Driven, grammar: dict[str, str]) -> None:
    request = GenerateRequest(prompt="Answer in the format asked:", sampling_params={
        "max_new_tokens": 40, "temperature": 0, **grammar})
    result = smol.run(request.run(smol.engine))
    assert result["meta_info"]["finish_reason"]["type"] == "stop"  # complete: the grammar rule applies
    smol.contract.check_result(request, result)


# ---- planted faults: an engine wrapped to break one rule ------------------------------------

class Planted:
    """An engine whose results and chunks pass through `result` and `chunks` on the way
    out, unchanged here; each subclass breaks one rule there."""

    def __init__(self, engine: sgl.AsyncEngine) -> None:
        self.engine = engine

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.result(await self.engine.generate(*args, **kwargs))

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.chunks(self.engine.stream(*args, **kwargs)):
            yield chunk

    def result(self, result: Any) -> Any:
        return result

    async def chunks(self, source: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        async for chunk in source:
            yield chunk


class KeepsTheStopString(Planted):
    def result(self, result: Any) -> Any:
        fin = result["meta_info"]["finish_reason"]
        return {**result, "text": result["text"] + fin["matched"]}


class DropsASample(Planted):
    def result(self, result: Any) -> Any:
        return result[:-1]


class SendsAChunkTwice(Planted):
    async def chunks(self, source: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        first = True
        async for chunk in source:
            yield chunk
            if first:
                yield copy.deepcopy(chunk)
                first = False


class DropsTheFinishReason(Planted):
    def result(self, result: Any) -> Any:
        return {**result, "meta_info": {**result["meta_info"], "finish_reason": None}}

    async def chunks(self, source: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        async for chunk in source:
            yield self.result(chunk)


class AbandonsStreams(Planted):
    """Yields a stream's first chunk and stops there, keeping the engine's stream open (as
    a caller holding an iterator it never finishes or closes): no abort is sent."""

    def __init__(self, engine: sgl.AsyncEngine) -> None:
        super().__init__(engine)
        self.held: list[Any] = []

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        source = self.engine.stream(*args, **kwargs)
        self.held.append(source)
        yield await source.__anext__()

    async def release(self) -> None:
        for source in self.held:
            await source.aclose()

    async def get_server_info(self) -> dict[str, Any]:
        return await self.engine.get_server_info()

    async def flush_cache(self) -> dict[str, Any]:
        return await self.engine.flush_cache()

    @property
    def open_requests(self) -> int:
        return self.engine.open_requests


GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


def caught(check: Callable[[], None]) -> str:
    with pytest.raises(ContractViolation) as e:
        check()
    return e.value.rule


def test_a_stop_string_left_in_the_text_is_caught(smol: Driven) -> None:
    request = GenerateRequest(prompt=COUNT, sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": ","})
    result = smol.run(request.run(KeepsTheStopString(smol.engine)))
    assert caught(lambda: smol.contract.check_result(request, result)) == "stop-trim"


def test_a_missing_sample_is_caught(null: Driven) -> None:
    request = GenerateRequest(input_ids=[3, 4], sampling_params={**GREEDY, "n": 3})
    result = null.run(request.run(DropsASample(null.engine)))
    assert caught(lambda: null.contract.check_result(request, result)) == "n"


def test_a_chunk_sent_twice_is_caught(null: Driven) -> None:
    request = GenerateRequest(input_ids=[3, 4], sampling_params=GREEDY, stream=True)
    chunks = null.run(request.run(SendsAChunkTwice(null.engine)))
    assert caught(lambda: null.contract.check_stream(request, chunks)) == "chunk-repeat"


def test_a_dropped_finish_reason_is_caught(null: Driven) -> None:
    request = GenerateRequest(input_ids=[3, 4], sampling_params=GREEDY)
    wrapper = DropsTheFinishReason(null.engine)
    result = null.run(request.run(wrapper))
    assert caught(lambda: null.contract.check_result(request, result)) == "finish-reason"
    chunks = null.run(request.streamed().run(wrapper))
    assert caught(lambda: null.contract.check_stream(request.streamed(), chunks)) == "chunk-final"


def test_an_abandoned_stream_is_caught_as_a_leak(null: Driven) -> None:
    request = GenerateRequest(input_ids=[3, 4], sampling_params=GREEDY, stream=True)
    wrapper = AbandonsStreams(null.engine)
    assert len(null.run(request.run(wrapper))) == 1
    assert caught(lambda: null.run(assert_engine_clean(wrapper))) == "leak-open"
    null.run(wrapper.release())  # closing the engine's stream ends the request


# ---- every rule, tripped by a result broken on purpose --------------------------------------

LOGPROBS = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "token_ids_logprob": [1, 2]}
BASES = {
    "one": GenerateRequest(input_ids=[5, 6, 7], sampling_params=GREEDY, options=LOGPROBS, rid="base"),
    "n": GenerateRequest(input_ids=[5, 6], sampling_params={**GREEDY, "n": 3}),
    "batch": GenerateRequest(input_ids=[[5], [6, 7]], sampling_params=GREEDY),
    "beams": GenerateRequest(input_ids=[5, 6], sampling_params={"beam_width": 2, "max_new_tokens": 3}),
    "stream": GenerateRequest(input_ids=[5, 6, 7], sampling_params=GREEDY, options={"return_logprob": True},
                              stream=True),
}
INFO = {"running": 0, "waiting": 0, "grammars_compiling": 0, "kv_free": 90, "kv_evictable": 10, "kv_protected": 0,
        "max_total_tokens": 100, "invariant_violations": 0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def bases(null: Driven) -> dict[str, Any]:
    """Each base request's real output on the null model."""
    return {name: null.run(request.run(null.engine)) for name, request in BASES.items()}


def meta(out: Any) -> dict[str, Any]:
    m: dict[str, Any] = out["meta_info"]
    return m


def crafted(text: str, sampling_params: dict[str, Any], ids: list[int], fin: dict[str, Any]) -> tuple[Any, Any]:
    """A one-prompt request and a result for it, made by hand."""
    request = GenerateRequest(input_ids=[1, 2], sampling_params=sampling_params)
    return request, {"text": text, "output_ids": ids, "meta_info": {
        "id": "x", "prompt_tokens": 2, "completion_tokens": len(ids), "cached_tokens": 0, "finish_reason": fin,
        "weight_version": "default",
        "e2e_latency": 0.1}}


def letters(ids: list[int], skip: bool, spaces: bool) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


TEXT_FACTS = EngineFacts(eos_token_ids=frozenset({999}), has_tokenizer=True)


def broken(rule: str, base: str, change: Callable[[Any], Any], facts: EngineFacts | None = None) -> Any:
    return pytest.param(rule, base, change, facts, id=f"{rule}-{base}")


def _set(mapping: dict[str, Any], key: str, value: Any) -> None:
    mapping[key] = value


# (rule, base, change: the base's output (a deep copy) -> what to check, facts)
CASES = [
    broken("shape", "one", lambda r: r.pop("text")),
    broken("meta", "one", lambda r: meta(r).pop("cached_tokens")),
    broken("meta", "one", lambda r: _set(meta(r), "weight_step", "1")),
    broken("meta", "one", lambda r: _set(meta(r), "weight_version", 1)),
    broken("meta-id", "one", lambda r: _set(meta(r), "id", "other")),
    broken("prompt-tokens", "one", lambda r: _set(meta(r), "prompt_tokens", 4)),
    broken("output-ids", "one", lambda r: r["output_ids"].pop()),
    broken("length", "one", lambda r: (r["output_ids"].append(1), _set(meta(r), "completion_tokens", 7))),
    broken("finish-reason", "one", lambda r: _set(meta(r), "finish_reason", {"type": "done"})),
    broken("finish-length", "one", lambda r: _set(meta(r), "finish_reason", {"type": "length", "length": 5})),
    broken("finish-stop", "one", lambda r: _set(meta(r), "finish_reason", {"type": "stop", "matched": 12})),
    broken("detokenize", "one", lambda r: _set(r, "text", "x")),
    broken("n", "n", lambda r: r.pop()),
    broken("batch", "batch", lambda r: r.pop()),
    broken("beams", "beams", lambda r: r.reverse()),
    broken("logprob-keys", "one", lambda r: meta(r).pop("input_token_logprobs")),
    broken("logprob-shape", "one", lambda r: meta(r)["output_token_logprobs"].__setitem__(0, (0.5, 1, None))),
    broken("logprob-shape", "one", lambda r: meta(r)["output_top_logprobs"][0].pop()),
    broken("chunk-shape", "stream", lambda c: _set(c[0], "index", 0)),
    broken("chunk-final", "stream", lambda c: _set(meta(c[-1]), "finish_reason", None)),
    broken("chunk-repeat", "stream", lambda c: c.insert(1, copy.deepcopy(c[0]))),
    broken("chunk-count", "stream", lambda c: _set(meta(c[0]), "completion_tokens",
                                                   meta(c[0])["completion_tokens"] + 1)),
    broken("chunk-logprobs", "stream", lambda c: meta(c[0])["output_token_logprobs"].append((-1.0, 1, None))),
]


@pytest.mark.parametrize("rule, base, change, facts", CASES)
def test_each_rule_catches_its_fault_in_a_real_output(null: Driven, bases: dict[str, Any], rule: str, base: str,
                                                     change: Callable[[Any], Any], facts: EngineFacts | None) -> None:
    request, out = BASES[base], copy.deepcopy(bases[base])
    contract = Contract(facts) if facts is not None else null.contract
    check = contract.check_stream if request.stream else contract.check_result
    check(request, out)  # the real output keeps the rules
    change(out)
    assert caught(lambda: check(request, out)) == rule


def test_stream_join_catches_a_result_that_differs(null: Driven, bases: dict[str, Any]) -> None:
    request = BASES["stream"]
    plain = request.streamed(False)
    result = null.run(plain.run(null.engine))
    null.contract.check_stream(request, bases["stream"], result)
    result["output_ids"][0] += 1
    meta(result)["output_token_logprobs"][0] = (-1.0, result["output_ids"][0], None)
    null.contract.check_result(plain, result)  # a good result on its own...
    assert caught(lambda: null.contract.check_stream(request, bases["stream"], result)) == "stream-join"


TEXT_CASES = [
    pytest.param("stop-trim", "1, 2", {"stop": ","}, [4, 5], {"type": "length", "length": 2}, TEXT_FACTS,
                 id="stop-string-left-in"),
    pytest.param("stop-trim", "1 2", {"stop": ",", "no_stop_trim": True}, [4, 5], {"type": "stop", "matched": ","},
                 TEXT_FACTS, id="no-stop-trim-lost-it"),
    pytest.param("text", "xyz", {}, [0, 1], {"type": "length", "length": 2},
                 EngineFacts(has_tokenizer=True, decode=letters), id="text-not-the-decode"),
    pytest.param("finish-stop", "ab", {"ignore_eos": True}, [0, 999], {"type": "stop", "matched": 999}, TEXT_FACTS,
                 id="eos-with-ignore-eos"),
    pytest.param("grammar", '{"a": "one"}', {"json_schema": json.dumps(SCHEMA)}, [7, 999],
                 {"type": "stop", "matched": 999}, TEXT_FACTS, id="json-breaks-the-schema"),
    pytest.param("grammar", '{"a": 1', {"json_schema": json.dumps(SCHEMA)}, [7, 999],
                 {"type": "stop", "matched": 999}, TEXT_FACTS, id="not-json"),
    pytest.param("grammar", "yes!", {"regex": "(yes|no)"}, [7, 999], {"type": "stop", "matched": 999}, TEXT_FACTS,
                 id="regex-not-matched"),
]


@pytest.mark.parametrize("rule, text, sp, ids, fin, facts", TEXT_CASES)
def test_text_rules_catch_crafted_results(rule: str, text: str, sp: dict[str, Any], ids: list[int],
                                          fin: dict[str, Any], facts: EngineFacts) -> None:
    request, result = crafted(text, {"max_new_tokens": 2, **sp}, ids, fin)
    assert caught(lambda: Contract(facts).check_result(request, result)) == rule
    good = {"stop-trim": "1 2" if "no_stop_trim" not in sp else "1,", "text": letters(ids, True, True),
            "grammar": '{"a": 1}' if "json_schema" in sp else "yes"}.get(rule)
    if good is not None:  # the same result with the right text keeps the rule
        Contract(facts).check_result(request, {**result, "text": good})


LEAK_CASES = [
    ("leak-requests", {"running": 1}), ("leak-requests", {"waiting": 2}), ("leak-requests", {"grammars_compiling": 1}),
    ("leak-kv", {"kv_free": 89}), ("leak-protected", {"kv_protected": 3}),
    ("leak-invariants", {"invariant_violations": 1}),
]


@pytest.mark.parametrize("rule, change", LEAK_CASES)
def test_leak_rules_catch_doctored_server_info(rule: str, change: dict[str, int]) -> None:
    assert_no_leaks(INFO)
    assert caught(lambda: assert_no_leaks({**INFO, **change})) == rule


def test_leak_rules_after_a_flush_and_with_open_requests() -> None:
    assert caught(lambda: assert_no_leaks(INFO, flushed=True)) == "leak-kv"  # a flush leaves nothing evictable
    assert_no_leaks({**INFO, "kv_free": 100, "kv_evictable": 0}, flushed=True, open_requests=0)
    assert caught(lambda: assert_no_leaks(INFO, open_requests=2)) == "leak-open"


def test_every_rule_has_a_fault_that_trips_it() -> None:
    tested = {p.values[0] for p in [*CASES, *TEXT_CASES]} | {rule for rule, _ in LEAK_CASES}
    assert tested | {"stream-join", "leak-open"} == set(RULES)  # those two: their own tests above


class Recorder:
    """An engine that keeps the arguments of each call and answers with placeholders."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def generate(self, **kwargs: Any) -> Any:
        self.calls.append(("generate", kwargs))
        return "result"

    async def stream(self, **kwargs: Any) -> AsyncIterator[str]:
        self.calls.append(("stream", kwargs))
        for chunk in ("a", "b"):
            yield chunk


class BlockingRecorder(Recorder):
    def generate(self, **kwargs: Any) -> Any:  # type: ignore[override]
        self.calls.append(("generate", kwargs))
        return iter(["a", "b"]) if kwargs.get("stream") else "result"


def test_a_request_calls_an_engine_with_its_arguments() -> None:
    request = GenerateRequest(input_ids=[[1], [2, 3]], sampling_params=[{"n": 2}, {}], options={"detokenize": False},
                              rid=["x", "y"])
    args = {"input_ids": [[1], [2, 3]], "sampling_params": [{"n": 2}, {}], "detokenize": False, "rid": ["x", "y"]}
    engine, blocking = Recorder(), BlockingRecorder()
    assert asyncio.run(request.run(engine)) == "result" == request.run_sync(blocking)
    assert asyncio.run(request.streamed().run(engine)) == ["a", "b"] == request.streamed().run_sync(blocking)
    assert engine.calls == [("generate", args), ("stream", args)]
    assert blocking.calls == [("generate", args), ("generate", {**args, "stream": True})]
    assert [(i.position, i.input_ids, i.params.n, i.rid, i.first_index) for i in request.items()] == [
        (0, [1], 2, "x", 0), (1, [2, 3], 1, "y", 2)]
