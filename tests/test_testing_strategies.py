"""sgl.testing.strategies against the engine's own code, without an engine: every drawn
valid request passes the checks the tokenizer manager makes (SamplingParams and
sgl/core/request_checks.py); every drawn invalid one is refused by a tokenizer manager
(on fake channels) with a ValueError naming the drawn field, every kind of break
included; drawn JSON schemas are schemas that xgrammar compiles as the scheduler does
and whose hypothesis-jsonschema instances validate; regexes compile in Python and
xgrammar; chat messages and tools are what the OpenAI routes take, and render
through the default model's chat template. Importing the kit's checker and
strategies loads neither torch nor transformers."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.core.request_checks import RequestLimits
from sgl.core.sampling_params import SamplingParams
from sgl.engine.batch_args import options_of
from sgl.runtime.req_options import check_request
from sgl.runtime.tokenizer_manager import TokenizerManager
from sgl.sched.json_schema_rewrite import for_xgrammar
from sgl.server.chat_render import conversation
from sgl.server.openai_protocol import ChatMessage, ChatRequest
from sgl.server.tool_calls import check_tools
from sgl.testing import strategies as sgs
from sgl.testing.strategies import GenerateRequest, InvalidRequest, Limits
from tests.fake_channels import AsyncQueueReceiver, ListSender
from tests.hypothesis_profiles import PROFILE

NO_TOKENIZER = Limits(vocab_size=1000, context_length=512, max_total_tokens=2000, has_tokenizer=False)
WITH_TOKENIZER = Limits(vocab_size=49152, context_length=2048, max_total_tokens=4000, max_new_tokens=64)
LIMITS = [pytest.param(NO_TOKENIZER, id="ids-only"), pytest.param(WITH_TOKENIZER, id="tokenizer")]


def request_limits(limits: Limits) -> RequestLimits:
    return RequestLimits(limits.vocab_size, limits.context_length, limits.max_total_tokens, limits.has_tokenizer,
                         max_top_logprobs_num=limits.max_top_logprobs_num,
                         max_running_requests=limits.max_running_requests)


@pytest.mark.parametrize("limits", LIMITS)
def test_drawn_requests_pass_the_engines_checks(limits: Limits) -> None:
    @settings(PROFILE, max_examples=PROFILE.max_examples // 2)
    @given(sgs.generate_requests(limits))
    def run(request: GenerateRequest) -> None:
        items = request.items()  # the engine's batch splitting and SamplingParams: a ValueError if refused
        assert not (request.stream and any(item.is_beam for item in items))
        for item in items:
            # A text prompt is tokenized by the engine: stand in the most tokens it can take.
            ids = item.input_ids if item.input_ids is not None else [1] * limits.text_prompt_tokens
            check_request(ids, item.params, item.options, request_limits(limits))
            assert item.params.max_new_tokens <= limits.max_new_tokens
            assert item.rid is None or isinstance(item.rid, str)

    run()


async def refusal(limits: Limits, request: GenerateRequest) -> str:
    """The ValueError a tokenizer manager raises for the (one-prompt) request, as an
    engine's front end hands it over; a request it accepts fails the test."""
    send = ListSender()
    tm = TokenizerManager(None, send, AsyncQueueReceiver(), request_limits(limits))
    try:
        gen = tm.generate(request.prompt, request.input_ids, request.sampling_params,  # type: ignore[arg-type]
                          request.rid, request.stream, options_of(dict(request.options)))
        with pytest.raises(ValueError) as e:
            # A refused request raises before anything is sent; an accepted one would wait for output.
            await asyncio.wait_for(gen.__anext__(), timeout=5)
        assert send.msgs == []
        return str(e.value)
    finally:
        await tm.close()


def assert_names_field(limits: Limits, bad: InvalidRequest) -> None:
    message = asyncio.run(refusal(limits, bad.request))
    assert re.search(rf"(?<![\w]){re.escape(bad.field)}(?![\w])", message), (bad.field, message)


@pytest.mark.parametrize("limits", LIMITS)
def test_invalid_requests_are_refused_naming_their_field(limits: Limits) -> None:
    @settings(PROFILE, max_examples=PROFILE.max_examples // 2)
    @given(sgs.invalid_requests(limits))
    def run(bad: InvalidRequest) -> None:
        assert_names_field(limits, bad)

    run()


@settings(PROFILE, max_examples=max(PROFILE.max_examples // 20, 3))
@given(st.data())
def test_every_kind_of_break_is_refused_naming_its_field(data: st.DataObject) -> None:
    limits = NO_TOKENIZER
    ids = data.draw(sgs.token_ids(limits))
    for field, changes in sgs._breaks(limits, len(ids)):
        params = data.draw(changes)
        assert_names_field(limits, InvalidRequest(GenerateRequest(input_ids=ids, sampling_params=params), field))
    for field, options in sgs._option_breaks(limits, len(ids)):
        request = GenerateRequest(input_ids=ids, sampling_params={"max_new_tokens": 1}, options=data.draw(options))
        assert_names_field(limits, InvalidRequest(request, field))


@settings(PROFILE, max_examples=max(PROFILE.max_examples // 4, 10))
@given(sgs.json_schemas(), st.data())
def test_json_schemas_compile_and_their_instances_validate(schema: dict[str, Any], data: st.DataObject) -> None:
    import xgrammar

    jsonschema.Draft202012Validator.check_schema(schema)
    xgrammar.Grammar.from_json_schema(for_xgrammar(json.dumps(schema)))  # as the scheduler compiles it
    value = data.draw(sgs.json_instances(schema))
    jsonschema.validate(value, schema)
    assert SamplingParams.coerce({"json_schema": json.dumps(schema)}).grammar is not None


@settings(PROFILE, max_examples=max(PROFILE.max_examples // 4, 10))
@given(sgs.regexes(), st.data())
def test_regexes_compile_in_python_and_xgrammar(regex: str, data: st.DataObject) -> None:
    import xgrammar

    xgrammar.Grammar.from_regex(regex)
    text = data.draw(st.from_regex(regex, fullmatch=True))
    assert re.fullmatch(regex, text)


@pytest.fixture(scope="module")
def chat_tokenizer() -> Any:
    from sgl.sched.models.default_model import default_model_dir
    from sgl.sched.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir(), False)


@settings(PROFILE, max_examples=max(PROFILE.max_examples // 8, 5))
@given(sgs.tools().flatmap(lambda ts: st.tuples(st.just(ts), sgs.chat_messages(tool_list=ts))))
def test_chat_messages_and_tools_are_what_the_openai_routes_take(chat_tokenizer: Any,
                                                                 drawn: tuple[list[Any], list[Any]]) -> None:
    tools, messages = drawn
    chat = msgspec.convert({"messages": messages, "tools": tools}, ChatRequest)
    assert check_tools(chat.tools) == tools
    assert messages[-1]["role"] in ("user", "tool")
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = [c for m in messages for c in m.get("tool_calls") or []]
    answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
    assert answered == {c["id"] for c in calls}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[call["function"]["name"]])
    conv = conversation(ChatMessage.parse(chat.messages))
    text = chat_tokenizer.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True)
    assert messages[-1]["content"] in text


def test_limits_bound_what_a_drawn_request_asks() -> None:
    limits = Limits.from_server_info({"vocab_size": 50, "context_length": 40, "max_total_tokens": 30},
                                     has_tokenizer=False, max_new_tokens=100)
    assert not limits.grammars and limits.max_new_tokens == 100
    assert limits.new_token_cap(10) == 20  # the KV pool: 30 slots
    assert limits.new_token_cap(10, width=4) == 5  # a beam holds a row per beam


def test_importing_the_checker_and_the_strategies_loads_no_torch() -> None:
    code = ("import sys, sgl.testing.contract, sgl.testing.strategies\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
