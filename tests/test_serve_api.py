"""`sgl serve` as a user meets it: the official openai client (completions and
chat, streamed and not; logprobs and echo checked against an attached engine's
own numbers), the native routes, the API key, sgl.Client, an AsyncEngine
attached over tcp, client disconnects, and a clean Ctrl-C.

One real server process on 127.0.0.1 (null model over SmolLM2's tokenizer and
chat template, tcp transport with a fixed key, native streams as deltas:
--incremental-streaming-output; tests/test_serve_surface.py covers the default,
cumulative streams); KV balanced after every test."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import sgl
from tests.serve_util import HTTP, ServerProc, alive, openai_client

API_KEY = "sk-test-123"
TRANSPORT_KEY = "ab" * 32


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProc]:
    from sgl.sched.models.default_model import default_model_dir

    s = ServerProc("--model-path", default_model_dir(), "--load-format", "null", "--transport", "tcp",
                   "--transport-key", TRANSPORT_KEY, "--max-total-tokens", "4000", "--served-model-name", "smol",
                   "--incremental-streaming-output", api_key=API_KEY)
    yield s
    s.stop(signal.SIGTERM)


@pytest.fixture(autouse=True)
def balanced(server: ServerProc) -> Iterator[None]:
    yield
    server.assert_balanced()


@pytest.fixture
def oai(server: ServerProc) -> Iterator[openai.OpenAI]:
    c = openai_client(server.url + "/v1", API_KEY, max_retries=0, timeout=30)
    yield c
    c.close()


def test_openai_completions(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="smol", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    again = oai.completions.create(model="smol", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert again.choices[0].text == r.choices[0].text

    chunks = list(oai.completions.create(model="smol", prompt="The capital of France is", max_tokens=5,
                                         temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_usage_reports_cached_prompt_tokens(oai: openai.OpenAI) -> None:
    """A repeated prompt is served from the radix cache, and usage says how much of it,
    the same way with and without streaming."""
    kw: dict[str, Any] = {"model": "smol", "prompt": "The radix cache holds this prompt for the second call",
                          "max_tokens": 2, "temperature": 0}
    first = oai.completions.create(**kw)
    second = oai.completions.create(**kw)
    before = first.usage.prompt_tokens_details.cached_tokens if first.usage.prompt_tokens_details else 0
    details = second.usage.prompt_tokens_details
    assert details is not None and before < details.cached_tokens < second.usage.prompt_tokens
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage == second.usage
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Say it again, please."}], "max_tokens": 2,
            "temperature": 0}
    oai.chat.completions.create(**chat)
    again = oai.chat.completions.create(**chat)
    assert again.usage.prompt_tokens_details is not None
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_openai_chat(oai: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = oai.chat.completions.create(model="smol", messages=msgs, max_tokens=6, temperature=0,
                                    extra_body={"top_k": 5, "min_p": 0.0, "ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens == 6
    stream = oai.chat.completions.create(model="smol", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert [m.id for m in oai.models.list().data] == ["smol"]


@functools.cache
def oai_tok() -> Any:
    """The served model's tokenizer."""
    from sgl.sched.models.default_model import default_model_dir
    from sgl.sched.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir())


def test_openai_logit_bias(oai: openai.OpenAI) -> None:
    tok = oai_tok()
    r = oai.completions.create(model="smol", prompt="Hello", max_tokens=4, temperature=0, logit_bias={"42": 100},
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([42] * 4)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="smol", prompt="Hello", max_tokens=4, logit_bias={"x": 1})
    assert "logit_bias" in str(e.value)


def test_openai_n_samples(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="smol", prompt=["Hello", "Bye"], max_tokens=3, temperature=0, n=2,
                               extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy samples agree
    assert r.usage.completion_tokens == 12
    msgs = [{"role": "user", "content": "Hi!"}]
    chat = oai.chat.completions.create(model="smol", messages=msgs, max_tokens=3, temperature=0, n=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 9
    chunks = list(oai.chat.completions.create(model="smol", messages=msgs, max_tokens=3, temperature=0, n=2,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    by_index: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + (ch.delta.content or "")
    assert by_index == {0: chat.choices[0].message.content, 1: chat.choices[0].message.content}
    assert chunks[-1].usage.completion_tokens == 6


def test_openai_streamed_batch(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "smol", "prompt": ["Hello", "Bye now"], "max_tokens": 3, "temperature": 1.0,
                          "seed": 7, "n": 2, "echo": True, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    r = oai.completions.create(**kw)
    assert r.choices[0].text.startswith("Hello") and r.choices[2].text.startswith("Bye now")
    assert r.choices[0].text != r.choices[1].text  # seed + i: the samples differ, so their order is checked
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    lists: dict[int, list[list[Any]]] = {}
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] = texts.get(ch.index, "") + ch.text
        lists[ch.index] = [a + b for a, b in zip(lists.get(ch.index, [[]] * 4), _lists(ch.logprobs))]
    assert texts == {c.index: c.text for c in r.choices}  # index = prompt_index * n + sample_index
    assert lists == {c.index: _lists(c.logprobs) for c in r.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    ids = list(oai.completions.create(model="smol", prompt=[[1, 2], [3]], max_tokens=2, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}))
    assert sorted(ch.index for c in ids for ch in c.choices if ch.finish_reason == "length") == [0, 1]


def test_native_streamed_batch(server: ServerProc) -> None:
    body: dict[str, Any] = {"input_ids": [[1, 2], [3]], "rid": ["nb-0", "nb-1"], "return_logprob": [False, True],
                            "sampling_params": [{"max_new_tokens": 3, "temperature": 0},
                                                {"max_new_tokens": 2, "temperature": 0, "n": 2}]}
    outs = server.post("/generate", json=body).json()
    with HTTP.stream("POST", server.url + "/generate", headers=server.headers, json={**body, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    per: dict[int, list[int]] = {}
    for ln in lines[:-1]:
        c = json.loads(ln[len("data:"):])
        per[c["index"]] = per.get(c["index"], []) + c["output_ids"]
        assert ("output_token_logprobs" in c["meta_info"]) == (c["index"] > 0)
    assert per == {0: outs[0]["output_ids"], 1: outs[1][0]["output_ids"], 2: outs[1][1]["output_ids"]}


def _native(server: ServerProc, **kw: Any) -> dict[str, Any]:
    """One request through an AsyncEngine attached over tcp, logprob token texts included."""
    async def main() -> dict[str, Any]:
        e = await sgl.AsyncEngine.connect(server.scheduler_address, transport_key=TRANSPORT_KEY)
        try:
            return await e.generate(**kw, return_logprob=True, return_text_in_logprobs=True)
        finally:
            await e.aclose()

    return asyncio.run(main())


def _lists(lp: Any) -> list[list[Any]]:
    return [lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset]


def test_openai_completion_logprobs_and_echo(oai: openai.OpenAI, server: ServerProc) -> None:
    from sgl.sched.models.null import null_next_token

    vocab = server.get("/get_model_info").json()["vocab_size"]
    # Null model: one logit of 1 at (t * 7 + 1) % vocab after t, 0 elsewhere, so a prompt
    # token has the high logprob exactly where it follows that rule (positions 2, 3 and 5).
    a, b = 1234, 50
    prompt = [9906, a, null_next_token(a, vocab), null_next_token(null_next_token(a, vocab), vocab), b,
              null_next_token(b, vocab)]
    hi, lo = 1 - math.log(math.e + vocab - 1), -math.log(math.e + vocab - 1)
    kw: dict[str, Any] = {"model": "smol", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}
    r = oai.completions.create(**kw, logprobs=3, echo=True)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([lo, hi, hi, lo, hi] + [hi] * 4, abs=1e-4)
    # Three top entries, and the chosen prompt token where it is not among them.
    assert [len(top) for top in lp.top_logprobs[1:]] == [4, 3, 3, 4, 3] + [3] * 4
    assert all(max(top.values()) == pytest.approx(hi, abs=1e-4) for top in lp.top_logprobs[1:])
    assert [top[tok] for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:])] == lp.token_logprobs[1:]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]

    # The same numbers and token strings as the engine's own answer; the text is prompt + completion.
    native = _native(server, input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True},
                     top_logprobs_num=3, logprob_start_len=0)
    m = native["meta_info"]
    triples = m["input_token_logprobs"] + m["output_token_logprobs"]
    assert lp.tokens == [t for _, _, t in triples] and lp.token_logprobs == [v for v, _, _ in triples]
    assert lp.top_logprobs[len(prompt):] == [{t: v for v, _, t in row} for row in m["output_top_logprobs"]]
    assert choice.text == oai_tok().decode(prompt) + native["text"]

    # logprobs=0 without echo: the completion's tokens only, each with just its own logprob.
    plain = oai.completions.create(**kw, logprobs=0).choices[0]
    assert plain.text == native["text"] and plain.logprobs.tokens == lp.tokens[len(prompt):]
    assert plain.logprobs.top_logprobs == [{t: v} for t, v in zip(plain.logprobs.tokens, lp.token_logprobs[-4:])]
    assert plain.logprobs.text_offset[0] == 0

    # Streamed: each chunk carries its own tokens; together they are the non-streamed lists.
    chunks = [c for c in oai.completions.create(**kw, logprobs=3, echo=True, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [sum(col, []) for col in zip(*(_lists(c.choices[0].logprobs) for c in chunks))] == _lists(lp)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None

    # Scoring (lm-eval): echo with max_tokens=0 gives the prompt's logprobs alone, as above.
    score = oai.completions.create(**{**kw, "max_tokens": 0}, logprobs=3, echo=True)
    assert score.choices[0].text == oai_tok().decode(prompt) and score.usage.completion_tokens == 0
    assert _lists(score.choices[0].logprobs) == [col[: len(prompt)] for col in _lists(lp)]
    streamed = [c for c in oai.completions.create(**{**kw, "max_tokens": 0}, logprobs=3, echo=True, stream=True)
                if c.choices]
    assert [sum(col, []) for col in zip(*(_lists(c.choices[0].logprobs) for c in streamed))] == \
        _lists(score.choices[0].logprobs)

    # Sampled: the chosen token is always among the top entries, so up to logprobs + 1 of them.
    sampled = oai.completions.create(**{**kw, "temperature": 1.0}, logprobs=2, seed=7).choices[0].logprobs
    assert all(tok in top and len(top) in (2, 3) for tok, top in zip(sampled.tokens, sampled.top_logprobs))
    assert any(len(top) == 3 for top in sampled.top_logprobs)


def test_openai_chat_logprobs(oai: openai.OpenAI, server: ServerProc) -> None:
    msgs = [{"role": "user", "content": "Hi!"}]
    kw: dict[str, Any] = {"model": "smol", "messages": msgs, "max_tokens": 5, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}
    r = oai.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert "".join(e.token for e in content) == r.choices[0].message.content

    tok = oai_tok()
    ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    native = _native(server, input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                             "ignore_eos": True}, top_logprobs_num=2)
    m = native["meta_info"]
    assert [(e.logprob, e.token) for e in content] == [(v, t) for v, _, t in m["output_token_logprobs"]]
    assert [[(x.logprob, x.token) for x in e.top_logprobs] for e in content] == \
        [[(v, t) for v, _, t in row] for row in m["output_top_logprobs"]]

    without_top = oai.chat.completions.create(**kw, logprobs=True).choices[0].logprobs.content
    assert [e.logprob for e in without_top] == [e.logprob for e in content]
    assert all(e.top_logprobs == [] for e in without_top)
    assert oai.chat.completions.create(**kw).choices[0].logprobs is None

    chunks = [c for c in oai.chat.completions.create(**kw, logprobs=True, top_logprobs=2, stream=True) if c.choices]
    assert [e for c in chunks for e in c.choices[0].logprobs.content] == content


def test_native_generate_logprobs(server: ServerProc) -> None:
    """/generate takes SGLang's logprob fields and returns the attached engine's numbers."""
    lp = {"return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 2, "token_ids_logprob": [5, 9],
          "return_text_in_logprobs": True}
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    prompt = [9906, 11, 1234, 50, 7]
    r = server.post("/generate", json={"input_ids": prompt, "sampling_params": sp, **lp})
    assert r.status_code == 200, r.text
    want = _native(server, input_ids=prompt, sampling_params=sp, logprob_start_len=2, top_logprobs_num=2,
                   token_ids_logprob=[5, 9])
    got, m = r.json(), json.loads(json.dumps(want["meta_info"]))  # tuples as JSON lists
    assert got["output_ids"] == want["output_ids"]
    keys = [k for k in m if "logprobs" in k]
    assert len(keys) == 6 and len(m["input_token_logprobs"]) == len(prompt) - 2
    assert {k: got["meta_info"][k] for k in keys} == {k: m[k] for k in keys}
    assert all(isinstance(text, str) for _, _, text in got["meta_info"]["output_token_logprobs"])

    # A batch with one value per prompt; a stream whose chunks add up to the whole.
    batch = server.post("/generate", json={"input_ids": [prompt, prompt], "sampling_params": sp,
                                           "return_logprob": [True, False], "logprob_start_len": [2, 0]}).json()
    assert batch[0]["meta_info"]["input_token_logprobs"] == [[v, t, None] for v, t, _ in m["input_token_logprobs"]]
    assert "input_token_logprobs" not in batch[1]["meta_info"]
    with HTTP.stream("POST", server.url + "/generate", headers=server.headers,
                     json={"input_ids": prompt, "sampling_params": sp, "stream": True, **lp}) as s:
        chunks = [json.loads(ln[5:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    assert [x for c in chunks for x in c["meta_info"]["output_token_logprobs"]] == m["output_token_logprobs"]


def test_openai_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="smol", prompt="x", max_tokens=5, temperature=-2)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    bad = openai_client(str(oai.base_url), "wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()


def test_native_routes(server: ServerProc) -> None:
    assert HTTP.get(server.url + "/health").status_code == 200  # no key needed
    assert HTTP.get(server.url + "/get_model_info").status_code == 401
    assert server.get("/health_generate").status_code == 200
    info = server.get("/get_model_info").json()
    assert info["served_model_name"] == "smol" and info["is_generation"]
    si = server.info()
    assert si["api_key"] == "<redacted>" and si["transport_key"] == "<redacted>"
    assert si["scheduler_address"] == server.scheduler_address
    out = server.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4
    batch = server.post("/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}})
    assert [len(o["output_ids"]) for o in batch.json()] == [2, 2]
    with HTTP.stream("POST", server.url + "/generate", headers=server.headers,
                     json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    # 3 tokens: up to 3 chunks (fewer where the server joined the ones its reader fell behind on).
    assert lines[-1] == "data: [DONE]" and 2 <= len(lines) <= 4
    # This server streams incrementally (--incremental-streaming-output): each chunk holds its new ids.
    assert sum(len(json.loads(ln[len("data: "):])["output_ids"]) for ln in lines[:-1]) == 3
    server.wait_idle()
    assert server.post("/flush_cache").json()["success"]
    m = server.get("/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    for name in ("sgl_prompt_tokens_total", "sgl_generation_tokens_total", "sgl_num_running_reqs",
                 "sgl_num_queue_reqs", "sgl_token_usage", "sgl_cache_hit_rate",
                 "sgl_time_to_first_token_seconds_bucket", "sgl_inter_token_latency_seconds_count",
                 "sgl_e2e_request_latency_seconds_sum"):
        assert name in m.text, name


def test_client_generate_stream_abort(server: ServerProc) -> None:
    async def main() -> None:
        async with sgl.Client(server.url, api_key=API_KEY) as c:
            out = await c.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 5, "temperature": 0})
            assert isinstance(out, dict) and len(out["output_ids"]) == 5
            chunks = [ch async for ch in c.stream(input_ids=[7, 8], sampling_params={"max_new_tokens": 5,
                                                                                    "temperature": 0})]
            assert [t for ch in chunks for t in ch["output_ids"]] == out["output_ids"]
            params = {"max_new_tokens": 3900, "ignore_eos": True}  # within the pool of 4000
            stream = c.stream(input_ids=[1], sampling_params=params, rid="abort-me")
            first = await stream.__anext__()
            assert first["meta_info"]["id"] == "abort-me"
            await c.abort("abort-me")
            rest = [ch async for ch in stream]
            assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            with pytest.raises(ValueError, match="temperature"):
                await c.generate("x", {"temperature": -1})
            scored = await c.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 5, "temperature": 0},
                                      return_logprob=True, logprob_start_len=0)
            assert isinstance(scored, dict) and scored["output_ids"] == out["output_ids"]
            assert len(scored["meta_info"]["output_token_logprobs"]) == 5
            assert len(scored["meta_info"]["input_token_logprobs"]) == 2
            streamed = [ch async for ch in c.stream(input_ids=[7, 8], sampling_params={"max_new_tokens": 5,
                                                    "temperature": 0}, return_logprob=True)]
            assert sum(len(ch["meta_info"]["output_token_logprobs"]) for ch in streamed) == 5
            with pytest.raises(ValueError, match="no_such_field"):
                await c.generate(input_ids=[7], no_such_field=1)
        async with sgl.Client(server.url, api_key="nope") as c:
            with pytest.raises(PermissionError):
                await c.generate("x")

    asyncio.run(main())


def test_client_on_a_server_it_cannot_reach() -> None:
    """Nothing listens: every call is a ServerError (503), never httpx's own exception, and
    health() says False."""
    import socket

    from sgl.client import ServerError

    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def main() -> None:
        async with sgl.Client(url) as c:
            assert await c.health() is False
            with pytest.raises(ServerError, match="^503: ConnectError"):
                await c.generate("x")
            with pytest.raises(ServerError, match="^503: ConnectError"):
                [ch async for ch in c.stream("x")]
            with pytest.raises(ServerError, match="^503"):
                await c.get_server_info()

    asyncio.run(main())


def test_disconnect_mid_stream_aborts(server: ServerProc) -> None:
    steps_before = server.info()["decode_steps"]

    async def main() -> None:
        async with sgl.Client(server.url, api_key=API_KEY) as c:
            stream = c.stream(input_ids=[3], sampling_params={"max_new_tokens": 3900, "ignore_eos": True})
            await stream.__anext__()
            assert server.info()["running"] == 1
            await stream.aclose()  # drops the connection

    asyncio.run(main())
    info = server.wait_idle(timeout=5)
    assert info["running"] == 0
    assert info["decode_steps"] - steps_before < 3500  # it did not run on to its 3900 tokens


def test_disconnect_while_waiting_for_a_plain_response_aborts(server: ServerProc) -> None:
    steps_before = server.info()["decode_steps"]
    body = {"input_ids": [4], "sampling_params": {"max_new_tokens": 3900, "ignore_eos": True}}
    # A quarter of a second: on a fast host the null model's lone request runs its 3,900
    # steps in about one.
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(server.url + "/generate", json=body, headers=server.headers, timeout=0.25)
    info = server.wait_idle(timeout=5)
    assert info["running"] == 0
    assert info["decode_steps"] - steps_before < 3500


def test_attached_engine_over_tcp(server: ServerProc) -> None:
    assert server.scheduler_address is not None

    async def main() -> None:
        e = await sgl.AsyncEngine.connect(server.scheduler_address, transport_key=TRANSPORT_KEY)
        assert isinstance(e, sgl.AttachedEngine) and not isinstance(e, sgl.AsyncEngine)
        try:
            out = await e.generate("Hello", {"max_new_tokens": 4, "temperature": 0}, rid="mine")
            assert out["meta_info"]["id"] == "mine" and len(out["output_ids"]) == 4
            over_http = server.post("/generate", json={"text": "Hello",
                                                       "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
            assert over_http.json()["output_ids"] == out["output_ids"]
            both = await asyncio.gather(
                e.generate(input_ids=[9], sampling_params={"max_new_tokens": 3, "temperature": 0}),
                asyncio.to_thread(server.post, "/generate",
                                  json={"input_ids": [9], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}))
            assert both[0]["output_ids"] == both[1].json()["output_ids"]
            chunks = [c async for c in e.stream(input_ids=[9], sampling_params={"max_new_tokens": 3, "temperature": 0})]
            assert [t for c in chunks for t in c["output_ids"]] == both[0]["output_ids"]
            assert await e.health()
        finally:
            await e.aclose()
        with pytest.raises(ConnectionError, match="transport_key"):
            await sgl.AsyncEngine.connect(server.scheduler_address, transport_key="cd" * 32, timeout=1.0)

    asyncio.run(main())


def test_sigint_shuts_down_cleanly(server: ServerProc) -> None:
    s = ServerProc("--load-format", "null", "--skip-tokenizer-init", "--max-total-tokens", "2000")
    info = s.info()
    pids = list(info["role_pids"].values())
    ipc_dir = os.path.dirname(info["scheduler_address"].removeprefix("ipc://"))
    with HTTP.stream("POST", s.url + "/generate", json={"input_ids": [1], "stream": True,
                                                        "sampling_params": {"max_new_tokens": 1900,
                                                                            "ignore_eos": True}}) as r:
        next(r.iter_lines())
        assert s.stop(signal.SIGINT) == 0
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(ipc_dir)

