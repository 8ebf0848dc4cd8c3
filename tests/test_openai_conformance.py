"""Peer conformance, part 1 (completions and chat): the request shapes and response
assertions of SGLang's OpenAI-server tests (test/srt/openai_server/...) and vLLM's
(tests/entrypoints/openai/...), rewritten here and run against one real `sgl serve`
on the default model (SmolLM2-135M-Instruct, real weights, float32) through the
official openai client. Each test's docstring names the peer tests it mirrors;
where this server deliberately answers otherwise, the test asserts our documented
behaviour and says so. tests/test_openai_conformance_more.py holds part 2
(structured output, errors, models, tokenize, metrics). Tool calls are left out
(tests/test_serve_tools.py). KV balanced after every test."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.peer_util import (
    API_KEY,
    CHAT,
    EOS_PROMPT,
    MODEL,
    NAME_PROMPT,
    chat,
    cmpl,
    sse_events,
    tokenizer,
)
from tests.serve_util import ServerProc, openai_client


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


# ---- completions --------------------------------------------------------------------------------------------


def test_single_completion(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_single_completion; SGLang basic/test_openai_server.py::
    TestOpenAIServer.test_completion (id, created, usage.prompt_tokens == the tokenizer's count, text
    and token-id prompts)."""
    tok = tokenizer()
    r = cmpl(oai, max_tokens=5)
    assert r.id and r.created and r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert len(r.choices[0].text) >= 5 and r.choices[0].finish_reason == "length"
    n_prompt = len(tok.encode(NAME_PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 5, n_prompt + 5)
    # vLLM (--enable-prompt-tokens-details) reports cached_tokens 0; this server leaves the details out
    # when nothing came from the radix cache.
    details = r.usage.prompt_tokens_details
    assert details is None or details.cached_tokens < n_prompt
    ids = cmpl(oai, prompt=[0, 0, 0, 0, 0], max_tokens=2)
    assert len(ids.choices[0].text) >= 1 and ids.usage.prompt_tokens == 5


@pytest.mark.parametrize("logprobs", [None, 0, 5])
def test_completion_logprobs_counts(oai: openai.OpenAI, logprobs: int | None) -> None:
    """vLLM test_completion.py::test_no_logprobs, ::test_zero_logprobs, ::test_some_logprobs (token-id prompt;
    the sampled token is always among the top ones, so `logprobs` or `logprobs + 1` entries)."""
    choice = cmpl(oai, prompt=[0, 0, 0, 0, 0], max_tokens=3, logprobs=logprobs).choices[0]
    if logprobs is None:
        assert choice.logprobs is None
        return
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert all(isinstance(t, str) for t in lp.tokens) and all(v <= 0 for v in lp.token_logprobs)
    for top in lp.top_logprobs:
        assert max(logprobs, 1) <= len(top) <= logprobs + 1


def test_too_many_logprobs_then_server_still_works(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_too_many_completion_logprobs and test_chat.py::test_too_many_chat_logprobs
    (at most 20, streamed or not; a following request is served)."""
    with pytest.raises(openai.BadRequestError):
        cmpl(oai, prompt=[0, 0, 0, 0, 0], max_tokens=5, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        list(cmpl(oai, prompt=[0, 0, 0, 0, 0], max_tokens=5, logprobs=30, stream=True))
    with pytest.raises(openai.BadRequestError):
        list(chat(oai, max_completion_tokens=10, logprobs=True, top_logprobs=21, stream=True))
    with pytest.raises(openai.BadRequestError):
        chat(oai, max_completion_tokens=10, logprobs=True, top_logprobs=30)
    assert chat(oai, max_completion_tokens=1).choices[0].message.content is not None


@pytest.mark.parametrize("logprobs", [1, 0])
def test_echo_logprobs(oai: openai.OpenAI, logprobs: int) -> None:
    """vLLM test_completion.py::test_echo_logprob_completion (text and token-id prompts); SGLang
    test_openai_server.py::run_completion with echo (text starts with the prompt, the first prompt token has
    no logprob). Also this server's echo with max_tokens=0: the prompt's logprobs alone (README)."""
    tok = tokenizer()
    for prompt in (NAME_PROMPT, [0, 0, 0, 0, 0]):
        r = cmpl(oai, prompt=prompt, max_tokens=1, echo=True, logprobs=logprobs)
        text = tok.decode(prompt) if isinstance(prompt, list) else prompt
        assert r.choices[0].text.startswith(text)
        lp = r.choices[0].logprobs
        assert len(lp.text_offset) == len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 5
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(max(logprobs, 1) <= len(top) <= logprobs + 1 for top in lp.top_logprobs[1:])
    only = cmpl(oai, max_tokens=0, echo=True, logprobs=1)
    assert only.choices[0].text == NAME_PROMPT and only.usage.completion_tokens == 0
    assert len(only.choices[0].logprobs.tokens) == only.usage.prompt_tokens


def test_completion_streaming(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_completion_streaming (the deltas join to the non-streamed text; one
    finish_reason, on the last chunk, which carries text)."""
    single = cmpl(oai, max_tokens=5).choices[0].text
    chunks = list(cmpl(oai, max_tokens=5, stream=True))
    assert [c.choices[0].finish_reason for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == single


def test_completion_stream_options(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_completion_stream_options (include_usage / continuous_usage_stats
    combinations, streamed)."""
    for opts in ({"include_usage": False, "continuous_usage_stats": False}, {}):
        assert all(c.usage is None for c in cmpl(oai, max_tokens=3, stream=True, stream_options=opts))
    chunks = list(cmpl(oai, max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens > 0 and last.usage.completion_tokens == 3
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    chunks = list(cmpl(oai, max_tokens=3, stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for c in chunks:
        assert c.usage is not None and c.usage.prompt_tokens > 0 and c.usage.completion_tokens > 0
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    # vLLM: include_usage False with continuous_usage_stats True sends no usage; here every chunk carries
    # it (continuous_usage_stats alone decides), a documented superset.


def test_stream_options_need_stream(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_completion_stream_options and test_chat.py::
    test_chat_completion_stream_options (stream=False with stream_options is a 400)."""
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        cmpl(oai, max_tokens=1, stream=False, stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        chat(oai, max_tokens=1, stream=False, stream_options={"include_usage": True})


def test_parallel_sampling(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_parallel_no_streaming and ::test_parallel_streaming (n samples at
    temperature 1 with a seed: indices 0..n-1, each with a finish_reason, all different; streamed, the
    chunks carry their index). vLLM's check that samples end at different lengths needs 50 tokens: left out."""
    n = 2
    r = cmpl(oai, max_tokens=3, n=n, temperature=1.0, seed=42, logprobs=0)
    assert [c.index for c in r.choices] == list(range(n)) and all(c.finish_reason for c in r.choices)
    assert len({c.text for c in r.choices}) == n and all(len(c.logprobs.tokens) == 3 for c in r.choices)
    texts: dict[int, list[str]] = defaultdict(list)
    finishes = 0
    for c in cmpl(oai, max_tokens=3, n=n, temperature=1.0, seed=42, stream=True):
        texts[c.choices[0].index].append(c.choices[0].text)
        finishes += c.choices[0].finish_reason is not None
    assert finishes == n and sorted(texts) == list(range(n)) and all(len(t) <= 3 for t in texts.values())
    # the same seed, the same samples, streamed or not
    assert ["".join(texts[i]) for i in range(n)] == [c.text for c in r.choices]


def test_batch_completions(oai: openai.OpenAI) -> None:
    """vLLM test_completion.py::test_batch_completions (a list of prompts, text or ids; with n=2 beam search
    the beams differ and the copies agree; streamed, one choice per chunk); SGLang test_openai_server.py::
    run_completion with a list prompt and n=2 (len(choices) == prompts * n, prompt tokens counted per prompt)."""
    tok = tokenizer()
    for prompts in ([NAME_PROMPT] * 2, [[0, 0, 0, 0, 0]] * 2):
        batch = cmpl(oai, prompt=prompts, max_tokens=2)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        n_prompt = len(prompts[0]) if isinstance(prompts[0], list) else len(tok.encode(NAME_PROMPT))
        assert batch.usage.prompt_tokens == 2 * n_prompt
    # vLLM runs the beams and the stream for both prompt kinds; one kind each keeps this test short
    beams = cmpl(oai, prompt=[NAME_PROMPT] * 2, max_tokens=2, n=2, extra_body={"use_beam_search": True})
    texts = [c.text for c in beams.choices]
    assert len(texts) == 4 and texts[0] != texts[1] and texts[0] == texts[2] and texts[1] == texts[3]
    streamed = ["", ""]
    for c in cmpl(oai, prompt=[[0, 0, 0, 0, 0]] * 2, max_tokens=2, stream=True):
        assert len(c.choices) == 1
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed[0] == streamed[1] == batch.choices[0].text  # the loop's last batch: the same id prompts


def test_completion_stream_echo_list_n(oai: openai.OpenAI) -> None:
    """SGLang test_openai_server.py::TestOpenAIServer.test_completion_stream (echo, logprobs, a list prompt
    and n=2 at once: each index's first chunk starts with its prompt, logprob tokens are strings, every
    index shows up, the usage chunk counts)."""
    prompt = "The capital of France is"
    seen: set[int] = set()
    usage = None
    for c in cmpl(oai, prompt=[prompt, prompt], max_tokens=2, echo=True, logprobs=2, n=2, stream=True,
                  stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage
            continue
        choice = c.choices[0]
        assert c.id and c.created and isinstance(choice.logprobs.tokens[0], str)
        if choice.index not in seen:
            assert choice.text.startswith(prompt)
            seen.add(choice.index)
        else:
            assert isinstance(choice.logprobs.top_logprobs[0], dict) and choice.logprobs.top_logprobs[0]
    assert seen == {0, 1, 2, 3}
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens == 8


def test_matched_stop_and_finish_reasons(oai: openai.OpenAI) -> None:
    """SGLang validation/test_matched_stop.py::test_finish_stop_str, ::test_finish_stop_eos,
    ::test_finish_length (finish_reason and matched_stop on completions and chat); OpenAI's stop semantics
    (the stop string is not part of the text)."""
    r = cmpl(oai, prompt="1. Apples\n2. Bananas\n3.", max_tokens=16, stop="\n").choices[0]
    assert (r.finish_reason, r.model_extra["matched_stop"]) == ("stop", "\n") and "\n" not in r.text
    eos = tokenizer().eos_token_id
    r = cmpl(oai, prompt=EOS_PROMPT, max_tokens=16).choices[0]
    assert (r.finish_reason, r.model_extra["matched_stop"]) == ("stop", eos)
    r = chat(oai, max_tokens=4, logit_bias={str(eos): 100}).choices[0]  # the EOS, forced at once
    assert (r.finish_reason, r.model_extra["matched_stop"]) == ("stop", eos)
    for r in (cmpl(oai, max_tokens=2).choices[0], chat(oai, max_tokens=2).choices[0]):
        assert (r.finish_reason, r.model_extra["matched_stop"]) == ("length", None)


def test_ignore_eos(oai: openai.OpenAI) -> None:
    """SGLang validation/test_openai_server_ignore_eos.py::test_ignore_eos (ignore_eos runs to max_tokens,
    finish_reason length, more tokens than without it)."""
    default = cmpl(oai, prompt=EOS_PROMPT, max_tokens=4, extra_body={"ignore_eos": False})
    forced = cmpl(oai, prompt=EOS_PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 4
    assert default.usage.completion_tokens < forced.usage.completion_tokens


# ---- chat ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("logprobs", "n"), [(None, 1), (5, 2)])
def test_chat_completion(oai: openai.OpenAI, logprobs: int | None, n: int) -> None:
    """SGLang test_openai_server.py::TestOpenAIServer.test_chat_completion (logprobs None/5, n 1/2: top
    logprobs of that length, an assistant message per choice, id, created, usage); vLLM test_chat.py::
    test_single_chat_session (finish_reason length at max_completion_tokens, exact usage, a second turn)."""
    r = chat(oai, max_completion_tokens=5, logprobs=logprobs is not None, top_logprobs=logprobs, n=n,
             temperature=0 if n == 1 else 0.7)
    assert r.id and r.created and r.object == "chat.completion" and len(r.choices) == n
    assert [c.index for c in r.choices] == list(range(n))
    for c in r.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.message.content
        assert c.finish_reason == "length"
        if logprobs is None:
            assert c.logprobs is None
        else:
            assert all(len(t.top_logprobs) == logprobs and isinstance(t.top_logprobs[0].token, str)
                       for t in c.logprobs.content)
    tok = tokenizer()
    n_prompt = len(tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False))
    # vLLM compares usage with CompletionUsage(...) exactly; here prompt_tokens_details (cached tokens)
    # comes along once the radix cache holds part of the prompt, so the counts are compared one by one.
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 5 * n,
                                                                                         n_prompt + 5 * n)
    turn = [*CHAT, {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "express your result in json"}]
    assert chat(oai, messages=turn, max_completion_tokens=2).choices[0].message.content is not None


@pytest.mark.parametrize(("logprobs", "n"), [(None, 1), (5, 2)])
def test_chat_streaming(oai: openai.OpenAI, logprobs: int | None, n: int) -> None:
    """vLLM test_chat.py::test_chat_streaming and ::test_chat_completion_n_parameter_streaming; SGLang
    test_openai_server.py::TestOpenAIServer.test_chat_completion_stream (the first delta of each index names
    the role, each index ends with exactly one finish_reason, logprob chunks carry top_logprobs of that length,
    the deltas join to the non-streamed answer)."""
    kw: dict[str, Any] = {"max_completion_tokens": 5, "logprobs": logprobs is not None, "top_logprobs": logprobs,
                          "n": n}
    single = chat(oai, **kw)
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    usage = None
    for c in chat(oai, **kw, stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage
            continue
        choice = c.choices[0]
        assert c.id and c.created and c.object == "chat.completion.chunk"
        assert (choice.delta.role == "assistant") == (choice.index not in texts)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
        if logprobs is not None and choice.delta.content:
            assert all(len(t.top_logprobs) == logprobs for t in choice.logprobs.content)
    assert sorted(texts) == list(range(n)) and all(len(f) == 1 for f in finishes.values()) and len(finishes) == n
    assert [texts[i] for i in range(n)] == [c.message.content for c in single.choices]
    assert [finishes[i][0] for i in range(n)] == [c.finish_reason for c in single.choices]
    assert usage is not None and usage.completion_tokens == 5 * n and usage.prompt_tokens > 0


def test_chat_stream_options(oai: openai.OpenAI) -> None:
    """vLLM test_chat.py::test_chat_completion_stream_options (no usage without include_usage; the usage
    chunk comes after the finish chunk, with no choices; continuous usage grows chunk by chunk up to
    min_tokens = max_completion_tokens)."""
    assert all(c.usage is None for c in chat(oai, max_completion_tokens=3, stream=True,
                                             stream_options={"include_usage": False}))
    chunks = list(chat(oai, max_completion_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[-2].choices[0].finish_reason is not None and chunks[-2].usage is None
    last = chunks[-1]
    assert last.choices == [] and last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    previous = 0
    for c in chat(oai, max_completion_tokens=3, stream=True, extra_body={"min_tokens": 3},
                  stream_options={"include_usage": True, "continuous_usage_stats": True}):
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert c.usage.completion_tokens > previous or (not c.choices and c.usage.completion_tokens == previous)
        previous = c.usage.completion_tokens
    assert previous == 3


@pytest.mark.parametrize(("logprobs", "top", "length"), [(False, None, None), (True, 0, 0), (True, 5, 5)])
def test_chat_logprobs_counts(oai: openai.OpenAI, logprobs: bool, top: int | None, length: int | None) -> None:
    """vLLM test_chat.py::test_no_logprobs_chat, ::test_zero_logprobs_chat, ::test_some_logprobs_chat."""
    choice = chat(oai, max_completion_tokens=3, logprobs=logprobs, top_logprobs=top).choices[0]
    if not logprobs:
        assert choice.logprobs is None
        return
    assert choice.logprobs.content and len(choice.logprobs.content[0].top_logprobs) == length
    assert all(t.logprob <= 0 and bytes(t.bytes or []).decode(errors="replace") for t in choice.logprobs.content)


def test_continue_final_message(oai: openai.OpenAI) -> None:
    """vLLM basic/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message; SGLang
    test_openai_server.py::test_response_prefill (the last assistant message is continued, not repeated).
    vLLM's chat `echo` is not part of this server's schema: a 400 unknown_parameter (README)."""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    msgs = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    r = chat(oai, messages=msgs, max_tokens=3, extra_body={"continue_final_message": True,
                                                            "add_generation_prompt": False})
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and saying not in r.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, messages=msgs, max_tokens=3, extra_body={"echo": True, "continue_final_message": True,
                                                            "add_generation_prompt": False})
    assert e.value.body["code"] == "unknown_parameter" and e.value.body["param"] == "echo"


def test_message_content_shapes(oai: openai.OpenAI) -> None:
    """vLLM test_chat.py::test_complex_message_content (a list of text parts reads as the string),
    ::test_custom_role and ::test_extra_fields_allowed: as vLLM, a custom role and an unknown message
    field are passed to the template (tests/test_openai_peer_checks.py checks what it renders)."""
    ask = "what is 1+1? please provide the result without any other text."
    text = chat(oai, messages=[{"role": "user", "content": ask}], max_tokens=2, seed=0)
    parts = chat(oai, messages=[{"role": "user", "content": [{"type": "text", "text": ask}]}], max_tokens=2, seed=0)
    assert parts.choices[0].message.content == text.choices[0].message.content
    assert chat(oai, messages=[{"role": "my-custom-role", "content": "what is 1+1?"}], max_tokens=1).choices
    assert chat(oai, messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}], max_tokens=1).choices


def test_thinking_off_without_a_reasoning_parser(server: ServerProc) -> None:
    """SGLang features/test_enable_thinking.py::test_chat_completion_without_reasoning and
    ::test_stream_chat_completion_without_reasoning (chat_template_kwargs enable_thinking=false with
    separate_reasoning: content, no reasoning_content), on a model that does not reason."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 3,
            "separate_reasoning": True, "chat_template_kwargs": {"enable_thinking": False}}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] and message.get("reasoning_content") is None
    r = server.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text) if e["choices"]]
    assert any(d.get("content") for d in deltas) and not any(d.get("reasoning_content") for d in deltas)


def test_usage_reports_cached_tokens(oai: openai.OpenAI) -> None:
    """SGLang features/test_cache_report.py::test_cache_report_openai (the same chat again: every prompt token
    but the last comes from the cache)."""
    msgs = [{"role": "user", "content": "How many sparrows do you need to lift a coconut?"}]
    chat(oai, messages=msgs, max_tokens=1)
    again = chat(oai, messages=msgs, max_tokens=1).usage
    assert again.prompt_tokens_details is not None
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1
