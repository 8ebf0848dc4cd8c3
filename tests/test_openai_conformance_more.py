"""Peer conformance, part 2: structured output (response_format, SGLang's regex and
ebnf), seeds, penalties and logit_bias, invalid requests and their OpenAI error
shape, length limits, /v1/models, /tokenize and /detokenize, /version, /health and
/metrics; from SGLang's (test/srt/openai_server/...) and vLLM's
(tests/entrypoints/openai/...) OpenAI-server tests, rewritten here and run against
one real `sgl serve` on the default model (real weights, float32). Part 1 is
tests/test_openai_conformance.py. KV balanced after every test."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

import sgl
from tests.peer_util import API_KEY, CHAT, EOS_PROMPT, MODEL, chat, cmpl, tokenizer
from tests.serve_util import HTTP, ServerProc, openai_client


@pytest.fixture
def server(peer_server: ServerProc) -> ServerProc:
    return peer_server  # one server for both conformance modules (tests/conftest.py)


@pytest.fixture(autouse=True)
def balanced(server: ServerProc) -> Iterator[None]:
    yield
    server.assert_balanced()


@pytest.fixture
def oai(server: ServerProc) -> Iterator[openai.OpenAI]:
    c = openai_client(server.url + "/v1", API_KEY, max_retries=0, timeout=120)
    yield c
    c.close()


# ---- structured output ----------------------------------------------------------------------------------


def test_response_format_json_schema_and_json_object(oai: openai.OpenAI) -> None:
    """vLLM test_chat.py::test_response_format_json_schema and ::test_response_format_json_object (the answer
    parses to {"result": 2}), ::test_response_format_text; SGLang features/test_json_mode.py::
    test_json_mode_with_streaming (json_object, streamed, joins to a JSON object)."""
    schema = {"type": "object", "properties": {"result": {"type": "integer"}}}
    r = chat(oai, messages=[{"role": "user", "content": 'what is 1+1? The format is "result": 2'}], max_tokens=16,
             response_format={"type": "json_schema", "json_schema": {"name": "foo_test", "schema": schema}})
    loaded = json.loads(r.choices[0].message.content or "")
    jsonschema.validate(loaded, schema)
    assert loaded == {"result": 2} and r.choices[0].finish_reason == "stop"
    ask = [{"role": "user", "content": 'what is 1+1? please respond with a JSON object, the format is {"result": 2}'}]
    # SGLang streams json_object, vLLM does not: streamed here, the joined deltas checked as vLLM checks the answer
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        oai, messages=ask, max_tokens=16, response_format={"type": "json_object"}, stream=True))
    assert json.loads(streamed) == {"result": 2}
    text = chat(oai, max_completion_tokens=2, response_format={"type": "text"})  # vLLM ::test_response_format_text
    assert text.choices[0].message.content is not None


def test_regex_and_ebnf(oai: openai.OpenAI) -> None:
    """SGLang basic/test_openai_server.py::test_regex (a JSON-shaped regex on chat; name a string, population an
    int), features/test_openai_server_ebnf.py::test_ebnf (a greeting grammar); vLLM test_chat.py::
    test_structured_outputs_choice_chat (a choice among strings, here as SGLang's ebnf, since vLLM's
    structured_outputs field is not part of this server's schema)."""
    regex = r'\{"name": "[A-Z][a-z]{1,8}", "pop": [0-9]{1,3}\}'
    r = chat(oai, messages=[{"role": "user", "content": "Introduce the capital of France."}], max_tokens=24,
             extra_body={"regex": regex})
    obj = json.loads(r.choices[0].message.content or "")
    assert isinstance(obj["name"], str) and isinstance(obj["pop"], int)
    greeting = chat(oai, messages=[{"role": "system", "content": "You are a helpful EBNF test bot."},
                                   {"role": "user", "content": "Say a greeting (Hello, Hi, or Hey)."}],
                    max_tokens=8, extra_body={"ebnf": 'root ::= "Hello" | "Hi" | "Hey"'})
    assert re.fullmatch(r"(Hello|Hi|Hey)[.!?]*\s*", greeting.choices[0].message.content or "")
    choices = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
    msgs = [{"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": "The best language for type-safe systems programming is "}]
    ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
    pick = chat(oai, messages=msgs, max_tokens=10, temperature=0.7, logprobs=True, top_logprobs=5,
                extra_body={"ebnf": ebnf})
    assert pick.choices[0].message.content in choices
    # vLLM ::test_structured_outputs_choice_chat_logprobs: no logprob below OpenAI's floor of -9999
    assert all(t.logprob >= -9999.0 for t in pick.choices[0].logprobs.content[0].top_logprobs)


@pytest.mark.parametrize(("field", "value"), [
    ("json_schema", {"properties": {"foo": "bar"}, "type": "object"}),
    ("regex", r"[.*"),
    ("ebnf", "root ::= select_statementinvalidsyntax\nselect_statement ::= \"SELECT \""),
    ("regex", {"1": "Python", "2": "C++"}),
])
def test_invalid_grammars(oai: openai.OpenAI, field: str, value: Any) -> None:
    """vLLM test_completion.py::test_invalid_json_schema, ::test_invalid_regex, ::test_invalid_grammar and
    test_chat.py::test_structured_outputs_type_error, with SGLang's field names (json_schema, regex, ebnf) for
    vLLM's structured_outputs: a 400 naming the field."""
    with pytest.raises(openai.BadRequestError) as e:
        cmpl(oai, prompt="Generate a JSON", max_tokens=4, extra_body={field: value})
    assert e.value.body["param"] == field


# ---- sampling fields --------------------------------------------------------------------------------------


def test_seed_and_penalties(oai: openai.OpenAI) -> None:
    """vLLM test_chat.py::test_chat_completion_n_with_seed and ::test_long_seed (a seed outside int64 is a 400);
    SGLang test_openai_server.py::test_penalty (frequency_penalty accepted)."""
    a, b = (cmpl(oai, max_tokens=3, temperature=1.0, seed=7).choices[0].text for _ in range(2))
    assert a == b
    r = chat(oai, max_completion_tokens=2, temperature=0.8, n=2, seed=42)
    assert [c.index for c in r.choices] == [0, 1] and all(c.message.content for c in r.choices)
    for seed in (-(2**63) - 1, 2**64):
        with pytest.raises(openai.BadRequestError) as e:
            chat(oai, max_tokens=1, seed=seed)
        # vLLM's message names pydantic's greater_than_equal / less_than_equal; this one names the field
        assert e.value.body["param"] == "seed"
    r = chat(oai, max_tokens=2, frequency_penalty=1.0, presence_penalty=0.5)
    assert isinstance(r.choices[0].message.content, str)


def test_logit_bias(oai: openai.OpenAI) -> None:
    """vLLM basic/test_chat_logit_bias_validation.py::test_chat_logit_bias_valid and ::
    test_chat_logit_bias_invalid (the last id is fine, one past the vocabulary is a 400 naming its size);
    a bias of 100 forces the token, as SGLang's and OpenAI's clients use it."""
    tok = tokenizer()
    vocab = len(tok)
    assert chat(oai, max_tokens=1, logit_bias={str(vocab - 1): 1.0}).choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, max_tokens=2, logit_bias={str(vocab + 1): 1.0})
    assert e.value.status_code == 400 and str(vocab) in str(e.value)
    forced = cmpl(oai, max_tokens=2, logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tok.decode([42] * 2)



# ---- invalid requests -------------------------------------------------------------------------------------

BAD: dict[str, tuple[str, Any, int, str | None]] = {  # name: (path, body, status, param)
    "missing prompt": ("/v1/completions", {"max_tokens": 5}, 400, None),
    "wrong type": ("/v1/completions", {"prompt": "hi", "max_tokens": "five"}, 400, "max_tokens"),
    "unknown field": ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    "negative max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    "n=0": ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    "temperature<0": ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    "top_p>1": ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    "empty prompt": ("/v1/completions", {"prompt": "", "max_tokens": 5}, 400, "prompt"),
    "out-of-vocab ids": ("/v1/completions", {"prompt": [999999], "max_tokens": 5}, 400, "prompt"),
    "empty messages": ("/v1/chat/completions", {"messages": [], "max_tokens": 5}, 400, "messages"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400,
                                      "top_logprobs"),
    "a list body": ("/v1/chat/completions", [1, 2], 400, None),
    "another model": ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_invalid_request_error_shape(server: ServerProc, name: str) -> None:
    """vLLM completion/test_prompt_validation.py::test_empty_prompt and ::test_out_of_vocab_token_ids (400s;
    vLLM's messages say "out of vocabulary", ours the id range); SGLang basic/test_openai_server.py::
    TestOpenAIServerv1Responses.test_error (the body's error has message, type and code); OpenAI's error
    object ({"error": {"message", "type", "param", "code"}}), on invalid values, types and fields."""
    path, body, status, param = BAD[name]
    r = server.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_bad_json_and_content_type(server: ServerProc, oai: openai.OpenAI) -> None:
    """vLLM basic/test_basic.py::test_request_wrong_content_type (a form-encoded Content-Type is refused);
    a body that is not JSON is a 400 in OpenAI's shape."""
    r = server.post("/v1/completions", content=b"{bad")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError):
        chat(oai, max_tokens=2, extra_headers={"Content-Type": "application/x-www-form-urlencoded"})


def test_length_limits(oai: openai.OpenAI) -> None:
    """SGLang validation/test_request_length_validation.py::test_input_length_longer_than_context_length and
    ::test_max_tokens_validation (a 400 naming the context length; OpenAI's context_length_exceeded code);
    vLLM's max_tokens=0 with echo (part 1) and this server's plain max_tokens=0: no tokens, finish length."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, messages=[{"role": "user", "content": "hello " * 9000}])
    assert "context length" in str(e.value) and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, messages=[{"role": "user", "content": "hello "}], max_tokens=9000)
    assert "context length" in str(e.value) and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, messages=[{"role": "user", "content": "hello "}], max_completion_tokens=9000)
    assert e.value.body["param"] == "max_completion_tokens"
    zero = cmpl(oai, max_tokens=0)
    assert zero.choices[0].text == "" and zero.choices[0].finish_reason == "length"
    assert zero.usage.completion_tokens == 0


# ---- models, tokenize, version, health, metrics -----------------------------------------------------------


def test_models(oai: openai.OpenAI) -> None:
    """SGLang basic/test_openai_server.py::test_model_list (one model with an int max_model_len) and
    ::test_retrieve_model (id and root the served name; another name is NotFoundError); vLLM
    test_models.py::test_check_models (the served model first, its id and root)."""
    models = list(oai.models.list())
    assert len(models) == 1 and models[0].id == MODEL and models[0].root == MODEL
    assert isinstance(models[0].model_extra["max_model_len"], int)
    got = oai.models.retrieve(MODEL)
    assert (got.id, got.root, got.object) == (MODEL, MODEL, "model")
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("non-existent-model")


def test_tokenize_and_detokenize(server: ServerProc) -> None:
    """vLLM test_tokenization.py::test_tokenize_completions, ::test_tokenize_chat,
    ::test_tokenize_with_return_token_strs and ::test_detokenize. Differences: token_strs is absent unless
    asked (vLLM sends null); the chat form takes no add_special_tokens=true (the template adds them: a 400);
    /detokenize answers SGLang's `text` beside vLLM's `prompt`."""
    tok = tokenizer()
    prompt = "vllm1 This is a test prompt."
    for special in (False, True):
        r = server.post("/tokenize", json={"add_special_tokens": special, "model": MODEL, "prompt": prompt}).json()
        tokens = tok.encode(prompt, add_special_tokens=special)
        assert (r["tokens"], r["count"], r["max_model_len"], r.get("token_strs")) == (tokens, len(tokens), 8192,
                                                                                      None)
    conversation = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Nice to meet you!"},
                    {"role": "user", "content": "Can I ask a question? vllm1"}]
    for add_generation, continue_final in ((False, False), (True, False), (False, True)):
        msgs = [*conversation, {"role": "assistant", "content": "Sure,"}] if continue_final else conversation
        text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation,
                                       continue_final_message=continue_final, tokenize=False)
        r = server.post("/tokenize", json={"add_generation_prompt": add_generation, "messages": msgs,
                                           "continue_final_message": continue_final, "model": MODEL}).json()
        tokens = tok.encode(text, add_special_tokens=False)
        assert (r["tokens"], r["count"], r["max_model_len"]) == (tokens, len(tokens), 8192)
    refused = server.post("/tokenize", json={"messages": conversation, "add_special_tokens": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_special_tokens"
    r = server.post("/tokenize", json={"prompt": prompt, "model": MODEL, "return_token_strs": True}).json()
    assert r["token_strs"] == tok.convert_ids_to_tokens(tok.encode(prompt, add_special_tokens=True))
    ids = tok.encode(prompt, add_special_tokens=False)
    assert server.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": prompt,
                                                                                         "text": prompt}


def test_version_and_health(server: ServerProc) -> None:
    """vLLM basic/test_basic.py::test_show_version ({"version": the package's}) and ::test_check_health (200,
    here without the API key too)."""
    r = server.get("/version")
    assert r.status_code == 200 and r.json() == {"version": sgl.__version__}
    assert HTTP.get(server.url + "/health", timeout=30).status_code == 200


def test_metrics_counts(server: ServerProc, oai: openai.OpenAI) -> None:
    """vLLM test_metrics.py::test_metrics_counts (after N requests the prompt and generation token counters, the
    request counter and the latency histograms' counts grow by exactly that) and ::test_abort_metrics_reset's
    end state (nothing running or queued, no KV in use). Time to first token counts the streamed request
    (the others arrive whole)."""
    ids = tokenizer().encode("Hello my name is Robert and I love magic")

    def scrape() -> dict[str, float]:
        r = server.get("/metrics")
        assert r.status_code == 200
        return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in r.text.splitlines()
                                         if ln and not ln.startswith("#"))}

    before = scrape()
    for _ in range(2):
        cmpl(oai, prompt=ids, max_tokens=3, extra_body={"ignore_eos": True})
    list(cmpl(oai, prompt=ids, max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    server.wait_idle()
    after = scrape()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("sgl_prompt_tokens_total") == 3 * len(ids) and grew("sgl_generation_tokens_total") == 9
    assert grew("sgl_requests_total") == 3 and grew("sgl_e2e_request_latency_seconds_count") == 3
    assert grew("sgl_time_to_first_token_seconds_count") == 1
    assert grew(f'sglang:prompt_tokens_total{{model_name="{MODEL}"}}') == 3 * len(ids)
    assert after["sgl_num_running_reqs"] == after["sgl_num_queue_reqs"] == after["sgl_kv_used_tokens"] == 0


def test_completion_of_an_eos_prompt_stops(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_completion_streaming's prompt ("What is an LLM?"), which this model ends at
    once: finish_reason stop with no text, streamed or not, and the usage chunk still counts the EOS token."""
    r = cmpl(oai, prompt=EOS_PROMPT, max_tokens=5)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    chunks = list(cmpl(oai, prompt=EOS_PROMPT, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 1
