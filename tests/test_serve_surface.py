"""The rest of `sgl serve`'s surface, as clients meet it: the served model name
(the model directory's by default) in /v1/models and /v1/models/{id} (the openai
client's retrieve), a 404 for another model's name, OpenAI fields that do not
apply accepted and ignored, earlier tool calls and tool messages rendered by the
template, `--chat-template` (a template string) with chat_template_kwargs,
/tokenize and /detokenize, /version, matched_stop, SGLang's cumulative native
streams (and sgl.Client's deltas from them), CORS, a random default seed.

One real server process (null model over SmolLM2's tokenizer, ipc, an API key,
a custom chat template, one allowed origin); KV balanced after every test."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import openai
import pytest

import sgl
from sgl.server.app import DEFAULT_MODEL_NAME, served_model_name
from tests.serve_util import HTTP, ServerProc, openai_client

API_KEY = "sk-surface"
NAME = "smollm2-135m-instruct"  # the default model's converted directory
ORIGIN = "http://app.test"
TEMPLATE = ("{% if greeting is defined %}{{ greeting }}|{% endif %}{% for m in messages %}<{{ m.role }}>"
            "{{ m.content }}{% if m.tool_calls %}[calls:{% for c in m.tool_calls %}{{ c.function.name }}"
            "{% endfor %}]{% endif %}{% if m.tool_call_id %}[id:{{ m.tool_call_id }}]{% endif %}</{{ m.role }}>"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProc]:
    from sgl.sched.models.default_model import default_model_dir

    s = ServerProc(default_model_dir(), "--load-format", "null", "--max-total-tokens", "4000",
                   "--chat-template", TEMPLATE, "--allow-origins", ORIGIN, api_key=API_KEY)
    yield s
    assert s.stop(signal.SIGTERM) == 0


@pytest.fixture(autouse=True)
def balanced(server: ServerProc) -> Iterator[None]:
    yield
    server.assert_balanced()


@pytest.fixture
def oai(server: ServerProc) -> Iterator[openai.OpenAI]:
    c = openai_client(server.url + "/v1", API_KEY, max_retries=0, timeout=30)
    yield c
    c.close()


def test_served_model_name_defaults() -> None:
    def name(model_path: str | None, resolved: str, served: str | None = None) -> str:
        return served_model_name(SimpleNamespace(model_path=model_path, served_model_name=served), resolved)

    assert name(None, "/root/.cache/sgl/smollm2-135m-instruct") == DEFAULT_MODEL_NAME
    assert name("/models/Qwen2.5-0.5B/", "/models/Qwen2.5-0.5B/") == "Qwen2.5-0.5B"
    assert name("/m/tiny.Q4_0.gguf", "/m/tiny.Q4_0.gguf") == "tiny.Q4_0"
    assert name("/models/x", "/models/x", served="my-model") == "my-model"


def test_models_version_and_seed(server: ServerProc, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == [NAME]
    card = oai.models.retrieve(NAME)
    assert card.id == NAME and "/" not in card.id and card.owned_by == "sgl"
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1)
    assert server.get("/version").json() == {"version": sgl.__version__}
    assert isinstance(server.info()["random_seed"], int)  # none given: sgl serve drew one


def test_openai_fields_that_do_not_apply_are_ignored(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": NAME, "messages": USER, "max_tokens": 4, "temperature": 0}
    plain = oai.chat.completions.create(**kw).choices[0].message.content
    extra = oai.chat.completions.create(
        **kw, store=True, metadata={"team": "a"}, user="u-1", service_tier="auto", reasoning_effort="low",
        extra_body={"separate_reasoning": True, "stream_reasoning": False, "priority": 3, "extra_key": "k"})
    assert extra.choices[0].message.content == plain
    text = oai.completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0, user="u-1").choices[0].text
    assert text == oai.completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0).choices[0].text
    # An assistant's earlier tool call and the tool's answer are accepted and rendered.
    msgs = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "42"}]
    assert oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=2).choices[0].finish_reason == "length"


def _rendered(server: ServerProc, **body: Any) -> str:
    r = server.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return str(server.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["text"])


def test_chat_template_and_its_kwargs(server: ServerProc) -> None:
    assert _rendered(server, messages=USER) == "<user>Hi</user><assistant>"
    assert _rendered(server, messages=USER, add_generation_prompt=False) == "<user>Hi</user>"
    assert _rendered(server, messages=USER, chat_template_kwargs={"greeting": "hello"}) == \
        "hello|<user>Hi</user><assistant>"
    msgs = [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}]
    assert _rendered(server, messages=msgs, add_generation_prompt=False) == \
        "<user>Hi</user><assistant>[calls:f]</assistant><tool>1[id:c]</tool>"
    # The chat route renders the same prompt, kwargs included.
    tokens = server.post("/tokenize", json={"messages": USER, "chat_template_kwargs": {"greeting": "yo"}}).json()
    r = server.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1,
                                                  "chat_template_kwargs": {"greeting": "yo"}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tokens["count"]


def test_tokenize_and_detokenize(server: ServerProc) -> None:
    one = server.post("/tokenize", json={"model": NAME, "prompt": "Hello world", "return_token_strs": True}).json()
    assert one["count"] == len(one["tokens"]) >= 2 and one["max_model_len"] == 8192
    assert "".join(one["token_strs"]).replace("Ġ", " ") == "Hello world"
    batch = server.post("/v1/tokenize", json={"prompt": ["Hello world", "Hi"]}).json()
    assert batch["tokens"][0] == one["tokens"] and batch["count"] == [len(t) for t in batch["tokens"]]
    back = server.post("/detokenize", json={"model": NAME, "tokens": one["tokens"]}).json()
    assert back == {"text": "Hello world", "prompt": "Hello world"}  # SGLang's and vLLM's names
    assert server.post("/v1/detokenize", json={"tokens": batch["tokens"]}).json() == {"text": ["Hello world", "Hi"]}
    assert server.post("/detokenize", json={"tokens": []}).json()["text"] == ""


def test_matched_stop(server: ServerProc, oai: openai.OpenAI) -> None:
    out = server.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    ids = out.json()["output_ids"]
    c = oai.completions.create(model=NAME, prompt="Hi", max_tokens=6, temperature=0,
                               extra_body={"stop_token_ids": [ids[2]]})
    assert c.choices[0].finish_reason == "stop" and c.choices[0].matched_stop == ids[2]  # type: ignore[attr-defined]
    first = server.post("/detokenize", json={"tokens": ids[:1]}).json()["text"]
    rest = out.json()["text"][len(first):]
    stop = rest.strip()[:3]
    chunks = list(oai.completions.create(model=NAME, prompt="Hi", max_tokens=6, temperature=0, stop=[stop],
                                         stream=True))
    last = [ch for ch in chunks if ch.choices][-1].choices[0]
    assert last.finish_reason == "stop" and last.matched_stop == stop  # type: ignore[attr-defined]
    plain = oai.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert plain.choices[0].matched_stop is None  # type: ignore[attr-defined]


def _events(server: ServerProc, body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
    with HTTP.stream("POST", server.url + "/generate", headers=server.headers, json={**body, "stream": True},
                     timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
        header = r.headers.get("x-sgl-stream-output")
    assert lines[-1] == "data: [DONE]"
    return header, [json.loads(ln[5:]) for ln in lines[:-1]]


def test_native_streams_are_cumulative_and_the_client_gets_deltas(server: ServerProc) -> None:
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = server.post("/generate", json={"text": "Hello", "sampling_params": sp, "return_logprob": True}).json()
    header, chunks = _events(server, {"text": "Hello", "sampling_params": sp, "return_logprob": True})
    assert header == "cumulative" and chunks  # one chunk a token, or fewer where a slow reader's joined
    for prev, cur in zip(chunks, chunks[1:]):  # each chunk holds everything so far
        assert cur["text"].startswith(prev["text"]) and cur["output_ids"][:len(prev["output_ids"])] == \
            prev["output_ids"]
    last = chunks[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert [x[:2] for x in last["meta_info"]["output_token_logprobs"]] == \
        [x[:2] for x in whole["meta_info"]["output_token_logprobs"]]
    # A batch: each request's chunks add up on their own.
    _, batch = _events(server, {"input_ids": [[1, 2], [3]], "sampling_params": sp})
    assert {c["index"]: len(c["output_ids"]) for c in batch} == {0: 5, 1: 5}

    async def main() -> None:
        async with sgl.Client(server.url, api_key=API_KEY) as c:
            parts = [ch async for ch in c.stream("Hello", sp, return_logprob=True)]
        assert "".join(p["text"] for p in parts) == whole["text"]
        assert [t for p in parts for t in p["output_ids"]] == whole["output_ids"]
        assert sum(len(p["meta_info"]["output_token_logprobs"]) for p in parts) == 5

    anyio.run(main)


def test_cors(server: ServerProc) -> None:
    pre = HTTP.options(server.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN  # no key for a preflight
    other = HTTP.options(server.url + "/v1/models", timeout=10, headers={
        "Origin": "http://evil.test", "Access-Control-Request-Method": "GET"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = HTTP.get(server.url + "/v1/models", headers={**server.headers, "Origin": ORIGIN}, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert HTTP.get(server.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10).status_code == 401


def test_accepted_connections_send_without_delay() -> None:
    """The listening socket has TCP_NODELAY and Linux hands it to each accepted connection:
    without it a kept-alive connection's first streamed event waited on the client's delayed
    ACK (about 40 ms of each later request's time to first token, measured with httpx)."""
    import socket

    from sgl.server.serve import _listen

    server = _listen("127.0.0.1", 0)
    client = socket.create_connection(server.getsockname()[:2])
    conn, _ = server.accept()
    try:
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        for s in (conn, client, server):
            s.close()
