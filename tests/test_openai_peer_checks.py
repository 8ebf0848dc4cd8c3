"""Peer conformance, part 3: the request and response fields SGLang's OpenAI-server tests
(test/srt/openai_server/...) and vLLM's (tests/entrypoints/openai/...) check beyond parts 1
and 2: context-overflow errors as OpenAI and vLLM word them, vLLM's prompt_logprobs and
structured_outputs (and guided_*), SGLang's stop_regex, usage.prompt_tokens_details,
extra message keys and custom roles, out-of-vocabulary ids named by position, and the
sglang:* / vllm:* Prometheus series. Real `sgl serve` (the session's shared peer server),
official openai client; each test's docstring names the peer checks it mirrors."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sgl.server.chat_render import conversation
from sgl.server.openai_protocol import ChatMessage
from tests.peer_util import API_KEY, CHAT, MODEL, NAME_PROMPT, chat, cmpl, sse_events, tokenizer
from tests.serve_util import ServerProc, openai_client


@pytest.fixture
def server(peer_server: ServerProc) -> ServerProc:
    return peer_server


@pytest.fixture(autouse=True)
def balanced(server: ServerProc) -> Iterator[None]:
    yield
    server.assert_balanced()


@pytest.fixture
def oai(server: ServerProc) -> Iterator[openai.OpenAI]:
    c = openai_client(server.url + "/v1", API_KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def context_length(oai: openai.OpenAI) -> int:
    return int(oai.models.list().data[0].model_extra["max_model_len"])


def bad_request(call: Any) -> dict[str, Any]:
    """The error body of a call that must be a 400."""
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400
    body = e.value.body
    assert isinstance(body, dict)
    return body


# ---- context overflow --------------------------------------------------------------------------------------


def test_prompt_past_the_context_is_worded_as_openai_and_vllm(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py / test_chat.py context-length checks and SGLang validation/
    test_request_length_validation.py::test_input_length_longer_than_context_length: a 400 with
    code context_length_exceeded and the sentence client libraries match on."""
    c = context_length(oai)
    long = "hello " * (c + 10)
    for call, param in ((lambda: cmpl(oai, prompt=long, max_tokens=1), "prompt"),
                        (lambda: chat(oai, messages=[{"role": "user", "content": long}], max_tokens=1), "messages")):
        body = bad_request(call)
        assert body["code"] == "context_length_exceeded" and body["param"] == param
        assert f"This model's maximum context length is {c} tokens." in body["message"]
        assert re.search(r"your request has \d+ input tokens", body["message"])


def test_max_tokens_past_the_context_names_both_parts(oai: openai.OpenAI) -> None:
    """SGLang validation/test_request_length_validation.py::test_max_tokens_validation; OpenAI's wording
    of the prompt and completion shares ("N in the messages, M in the completion")."""
    c, n = context_length(oai), len(tokenizer().encode(NAME_PROMPT))
    body = bad_request(lambda: cmpl(oai, max_tokens=c))
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    assert f"maximum context length is {c} tokens. However, you requested {n + c} tokens ({n} in the messages, " \
           f"{c} in the completion)" in body["message"]
    body = bad_request(lambda: chat(oai, max_completion_tokens=c))
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_completion_tokens"


# ---- out-of-vocabulary ids ---------------------------------------------------------------------------------


def test_out_of_vocabulary_ids_are_named_with_their_position(oai: openai.OpenAI) -> None:
    """vLLM completion/test_prompt_validation.py::test_out_of_vocab_token_ids and test_chat.py's invalid
    logit_bias check: the 400 names the id, where it is, and the vocabulary's size."""
    v = len(tokenizer())
    body = bad_request(lambda: cmpl(oai, prompt=[1, 2, 3, v], max_tokens=1))
    assert body["message"] == f"prompt[3]={v} is out of the vocabulary (size {v})" and body["param"] == "prompt"
    body = bad_request(lambda: cmpl(oai, prompt=[[1], [2, v + 5]], max_tokens=1))
    assert f"prompt[1][1]={v + 5} is out of the vocabulary (size {v})" in body["message"]
    body = bad_request(lambda: chat(oai, max_tokens=1, logit_bias={str(v): 1.0}))
    assert body["message"] == f"logit_bias: token id {v} is out of the vocabulary (size {v})"
    assert body["param"] == "logit_bias"


# ---- prompt_logprobs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 3])
def test_completion_prompt_logprobs(oai: openai.OpenAI, k: int) -> None:
    """vLLM test_completion.py::test_prompt_logprobs_completion: one entry per prompt token, the first
    null, each holding the prompt's own token (so k or k + 1 entries); logprobs stays separate."""
    ids = tokenizer().encode(NAME_PROMPT)
    r = cmpl(oai, max_tokens=2, logprobs=1, extra_body={"prompt_logprobs": k})
    choice = r.choices[0]
    plp = choice.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and len(entry) in (k, k + 1)
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values())
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks == list(range(1, len(ranks) + 1))
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)  # logprobs=1, not k


def test_chat_prompt_logprobs_and_stream_refusal(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_prompt_logprobs_chat (top-level prompt_logprobs on chat) and
    ::test_more_than_one_prompt_logprobs_chat / the stream rule (prompt_logprobs with stream=true is a 400)."""
    r = chat(oai, max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = r.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.usage.prompt_tokens and all(1 <= len(e) <= 2 for e in plp[1:])
    assert r.choices[0].logprobs is None
    body = bad_request(lambda: cmpl(oai, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}))
    assert body["param"] == "prompt_logprobs"
    assert bad_request(lambda: chat(oai, max_tokens=1, extra_body={"prompt_logprobs": 21}))["param"] == \
        "prompt_logprobs"


# ---- structured_outputs ------------------------------------------------------------------------------------


def test_structured_outputs_choice_regex_and_json(oai: openai.OpenAI) -> None:
    """vLLM test_completion_with_prompt... / structured outputs tests: structured_outputs' choice,
    regex and json (and the older guided_choice) constrain the output."""
    choices = ["Paris", "London", "Rome (Italy)"]
    r = chat(oai, max_tokens=10, extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].message.content in choices
    r = chat(oai, max_tokens=10, extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices
    r = cmpl(oai, max_tokens=10, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text)
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}
    r = chat(oai, max_tokens=30, extra_body={"structured_outputs": {"json": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["age"], int)


def test_structured_outputs_refusals_name_the_field(oai: openai.OpenAI) -> None:
    """vLLM's 400s for conflicting or unknown structured output options."""
    body = bad_request(lambda: chat(oai, max_tokens=2, extra_body={"structured_outputs": {"choice": ["a"],
                                                                                          "regex": "a"}}))
    assert "structured_outputs.choice cannot be combined with structured_outputs.regex" in body["message"]
    body = bad_request(lambda: chat(oai, max_tokens=2, extra_body={"structured_outputs": {"structural_tag": "x"}}))
    assert body["param"] == "structured_outputs" and body["code"] == "unsupported_parameter"
    body = bad_request(lambda: chat(oai, max_tokens=2, extra_body={"structured_outputs": {"choice": []}}))
    assert body["param"] == "structured_outputs.choice"


# ---- stop_regex --------------------------------------------------------------------------------------------


def test_stop_regex_ends_and_trims_the_output(oai: openai.OpenAI, server: ServerProc) -> None:
    """SGLang's stop_regex (test_openai_server.py-style completions with sampling extras): generation
    stops where the regex matches, the text is cut there, matched_stop is the matched text; the stream
    joins to the same text."""
    full = cmpl(oai, max_tokens=8).choices[0].text
    m = re.search(r"[aA]n[a-z]", full)
    assert m is not None, full  # greedy: " Alex, and I'm ..."
    r = cmpl(oai, max_tokens=8, extra_body={"stop_regex": r"[aA]n[a-z]"})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.text == full[:m.start()]
    assert choice.model_extra["matched_stop"] == m.group()
    resp = server.post("/v1/completions", json={"model": MODEL, "prompt": NAME_PROMPT, "temperature": 0,
                                                "max_tokens": 8, "stream": True, "stop_regex": [r"[aA]n[a-z]"]})
    events = sse_events(resp.text)
    assert "".join(e["choices"][0]["text"] for e in events) == choice.text
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_regex_refuses_bad_patterns(oai: openai.OpenAI) -> None:
    body = bad_request(lambda: cmpl(oai, max_tokens=2, extra_body={"stop_regex": "a("}))
    assert body["param"] == "stop_regex" and body["message"].startswith("stop_regex='a(' is invalid")
    body = bad_request(lambda: cmpl(oai, max_tokens=2, extra_body={"stop_regex": "x*"}))
    assert body["param"] == "stop_regex" and "matches no empty text" in body["message"]


# ---- usage details -----------------------------------------------------------------------------------------


def test_cached_tokens_are_always_reported(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py / test_chat.py with prompt tokens details: usage.prompt_tokens_details.
    cached_tokens on every response (0 included), the repeat of a prompt served from the cache; in a
    stream's final usage too."""
    # Its first character begins no other test's prompt: a radix match even of one leading
    # token (a random hex digit shared with an earlier prompt) would make it no longer fresh.
    prompt = f"¤ {uuid.uuid4().hex} is a fresh prompt that no request sent before, long enough to be cached"
    first = cmpl(oai, prompt=prompt, max_tokens=1).usage
    assert first.prompt_tokens_details is not None and first.prompt_tokens_details.cached_tokens == 0
    again = cmpl(oai, prompt=prompt, max_tokens=1).usage
    assert 0 < again.prompt_tokens_details.cached_tokens < again.prompt_tokens
    chunks = list(chat(oai, max_tokens=2, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 0


# ---- messages ----------------------------------------------------------------------------------------------


def test_extra_message_fields_and_custom_roles_are_accepted(oai: openai.OpenAI, server: ServerProc) -> None:
    """vLLM test_chat.py::test_extra_fields_allowed and ::test_custom_role: unknown keys inside a message
    and a role of the caller's are no 400; the template renders the custom role."""
    r = chat(oai, max_tokens=2, messages=[{"role": "user", "content": "hi", "extra_field": "0"}])
    assert r.choices[0].message.content is not None
    custom = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    r = chat(oai, max_tokens=2, messages=custom)
    assert r.choices[0].finish_reason is not None
    tok = server.post("/tokenize", json={"model": MODEL, "messages": custom, "return_token_strs": True})
    assert tok.status_code == 200
    assert "my-custom-role" in tokenizer().decode(tok.json()["tokens"])
    body = bad_request(lambda: chat(oai, max_tokens=2, messages=[{"role": 5, "content": "hi"}]))
    assert body["param"] == "messages" and body["message"].startswith("messages[0]: ")


def test_unknown_message_keys_reach_the_template() -> None:
    conv = conversation(ChatMessage.parse([*CHAT, {"role": "critic", "content": "x", "mood": "terse",
                                                   "extra": {"a": 1}}]))
    assert conv[-1] == {"role": "critic", "content": "x", "mood": "terse", "extra": {"a": 1}}
    assert conv[0] == CHAT[0]


# ---- metrics -----------------------------------------------------------------------------------------------


def scrape(server: ServerProc) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(server.get("/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_carry_sglang_and_vllm_names_and_count_every_request(oai: openai.OpenAI,
                                                                    server: ServerProc) -> None:
    """vLLM test_metrics.py (the vllm:* series a client scrapes, request counts by finished_reason) and
    SGLang's metrics test (sglang:* series): n=2 is two requests, each observed once; only the
    streamed one has a time to first token and inter-token latencies (the others arrive whole)."""
    label = (("model_name", MODEL),)
    before = scrape(server)
    cmpl(oai, max_tokens=3)
    cmpl(oai, max_tokens=3, n=2, temperature=1.0, seed=1)
    list(chat(oai, max_tokens=3, stream=True))
    server.wait_idle()
    after = scrape(server)

    def grew(name: str, labels: tuple[tuple[str, str], ...] = label) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    for name in ("sglang:e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "sglang:num_requests_total"):
        assert grew(name) == 4, name
    for name in ("sglang:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"):
        assert grew(name) == 1, name
    assert grew("vllm:request_success_total", (("finished_reason", "length"), *label)) == 4
    assert grew("vllm:generation_tokens_total") == 12 == grew("sglang:generation_tokens_total")
    assert grew("vllm:inter_token_latency_seconds_count") == 2
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput", "sglang:token_usage",
                 "sglang:cache_hit_rate", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert (name, label) in after, name
    assert after[("sglang:gen_throughput", label)] > 0
