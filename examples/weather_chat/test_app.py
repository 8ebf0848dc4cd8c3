"""Tests of the weather chat, written with sgl.testing: a FakeEngine scripted by
responders, faults on virtual time, Hypothesis, the contract checker on what the engine
sent, and the real engine on the null model. No GPU, no weights; but for the last test,
no torch either."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings

from examples.weather_chat.app import CALL_SCHEMA, ChatEngine, ChatError, ask
from sgl import SamplingParams
from sgl.testing import (
    Die,
    EngineFacts,
    FakeEngine,
    FaultPlan,
    GenerateRequest,
    Nth,
    SlowFirstToken,
    assert_engine_clean,
    check_stream,
    run_virtual,
    tokenizer_decoder,
)
from sgl.testing.strategies import Limits, json_instances, text_prompts

PARIS = json.dumps({"tool": "get_weather", "arguments": {"city": "Paris"}})


def weather_model(prompt: str, params: SamplingParams) -> str:
    """A responder that plays the model: a tool call when asked under the app's JSON
    schema, then an answer that depends on the forecast the app put in the prompt."""
    if params.json_schema is not None:
        return PARIS
    return "Take an umbrella." if "light rain" in prompt else "No umbrella needed."


@pytest.fixture
def sgl_fake_responder() -> Any:
    return weather_model  # what the plugin's sgl_fake_engine answers in this module


@pytest.fixture(scope="module")
def sgl_server_args() -> dict[str, Any]:
    return {"max_total_tokens": 4096}  # sgl_null_engine's KV pool, small on a CPU with real weights too


class Recorded:
    """An engine that passes each stream on and keeps its request and chunks."""

    def __init__(self, engine: ChatEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[GenerateRequest, list[dict[str, Any]]]] = []

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def stream(self, prompt: str, sampling_params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        self.calls.append((GenerateRequest(prompt=prompt, sampling_params=sampling_params, stream=True), chunks))
        async for chunk in self.engine.stream(prompt, sampling_params):
            chunks.append(chunk)
            yield chunk

    def check_contract(self, info: dict[str, Any]) -> None:
        facts = EngineFacts.from_server_info(info, has_tokenizer=True, decode=tokenizer_decoder(self.tokenizer))
        for request, chunks in self.calls:
            check_stream(request, chunks, facts=facts)


def test_a_weather_question_calls_the_tool_and_streams_the_answer(sgl_fake_engine: FakeEngine) -> None:
    engine = Recorded(sgl_fake_engine)
    pieces: list[str] = []

    async def main() -> Any:
        reply = await ask(engine, "Do I need an umbrella in Paris today?", on_text=pieces.append)
        engine.check_contract(await sgl_fake_engine.get_server_info())
        return reply

    reply = asyncio.run(main())
    assert reply.tool_calls == [{"city": "Paris", "result": {"city": "Paris", "celsius": 14, "sky": "light rain"}}]
    assert reply.text == "Take an umbrella." == "".join(pieces)
    assert len(pieces) > 1  # streamed as it was written
    assert ["".join(c["text"] for c in chunks) for _, chunks in engine.calls] == [PARIS, "Take an umbrella."]


def test_a_question_without_weather_calls_no_tool() -> None:
    no_call = json.dumps({"tool": "none", "arguments": {"city": ""}})

    async def main() -> Any:
        async with FakeEngine([no_call, "Four."]) as engine:  # one text per request, in turn
            return await ask(engine, "What is 2 + 2?", weather=lambda city: pytest.fail("called the tool"))

    reply = run_virtual(main())
    assert (reply.text, reply.tool_calls) == ("Four.", [])


def test_the_engine_dying_mid_answer_is_a_chat_error() -> None:
    pieces: list[str] = []

    async def main() -> None:
        plan = FaultPlan()
        plan.add(Die(after_tokens=5), when=Nth(2))  # request 2 is the answer: it dies after 5 tokens
        async with FakeEngine(weather_model, faults=plan) as engine:
            with pytest.raises(ChatError, match="died"):
                await ask(engine, "Umbrella in Paris?", on_text=pieces.append)
            assert engine.dead_reason() is not None

    run_virtual(main())
    assert "".join(pieces) == "Take "


@pytest.mark.parametrize(("first_token_s", "outcome", "waited_s"), [
    (20.0, "answered", 20.0),
    (120.0, "the model sent nothing for 30.0 s", 30.0),
])
def test_a_slow_first_token_meets_the_apps_timeout(first_token_s: float, outcome: str, waited_s: float) -> None:
    async def main() -> tuple[str, float]:
        plan = FaultPlan()
        plan.next_request(SlowFirstToken(first_token_s))
        loop = asyncio.get_running_loop()
        async with FakeEngine(weather_model, faults=plan) as engine:
            began = loop.time()
            try:
                await ask(engine, "Umbrella in Paris?", timeout_s=30.0)
                seen = "answered"
            except ChatError as e:
                seen = str(e)
            waited = loop.time() - began
            await assert_engine_clean(engine)  # a timed-out request was aborted: nothing leaked
        return seen, waited

    seen, waited = run_virtual(main())  # virtual time: the test takes milliseconds
    assert seen == outcome
    assert waited == pytest.approx(waited_s)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(call=json_instances(CALL_SCHEMA), question=text_prompts(Limits()))
def test_every_tool_call_the_schema_allows(call: dict[str, Any], question: str) -> None:
    cities: list[str] = []

    def model(prompt: str, params: SamplingParams) -> str:
        return json.dumps(call, ensure_ascii=False) if params.json_schema is not None else "Done."

    def weather(city: str) -> dict[str, Any]:
        cities.append(city)
        return {"sky": "clear"}

    async def main() -> Any:
        async with FakeEngine(model) as engine:
            return await ask(engine, question, weather=weather)

    reply = run_virtual(main())
    assert reply.text == "Done."
    assert cities == ([call["arguments"]["city"]] if call["tool"] == "get_weather" else [])


def test_on_the_real_engine(sgl_null_engine: Any) -> None:
    """The null model (or `pytest --sgl-model-path PATH`'s model): its tool call parses,
    its answer streams, and both streams keep the engine's contract, the tool call's
    JSON included."""
    engine = Recorded(sgl_null_engine)
    reply = asyncio.run(ask(engine, "Do I need an umbrella in Paris today?"))
    assert len(engine.calls) == 2 and len(reply.tool_calls) <= 1
    engine.check_contract(asyncio.run(sgl_null_engine.get_server_info()))
