"""Any body a client sends to the routes that take a prompt (/generate, /v1/completions,
/v1/chat/completions, the tokenizer's and the embedding routes) gets an answer in time: a
200 of the route's shape (a stream ends with [DONE], every event JSON), or a 400/404 in
OpenAI's error shape, never a 5xx or an internal error inside a stream. Bodies are drawn
from the routes' own request schemas (msgspec's JSON schema of each Struct): a few fields
at a time, values of the declared types biased to edges, now and then one of another type
or an unknown field. After them the server still answers and its KV accounting balances. The table of known bad inputs
is tests/test_serve_bad_inputs.py; this test is for the combinations no table lists.

The schema walker is written here because hypothesis-jsonschema's object strategy no
longer runs on the Hypothesis this project uses (sgl.testing.strategies says why), and
these schemas use only $ref, anyOf, the JSON types, items and additionalProperties."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl.server.embeddings_api import EmbeddingRequest, EncodeRequest
from sgl.server.native import GenerateRequest
from sgl.server.openai_protocol import ChatRequest, CompletionRequest
from sgl.server.tokenize_api import DetokenizeRequest, TokenizeRequest
from tests.hypothesis_profiles import PROFILE
from tests.serve_util import HTTP, ServerProc

API_KEY = "sk-fuzz"
GENERATION = {"/generate": GenerateRequest, "/v1/completions": CompletionRequest,
              "/v1/chat/completions": ChatRequest}
# The tokenizer's routes, and the embedding routes (which this generation model refuses).
OTHERS = {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest, "/v1/embeddings": EmbeddingRequest,
          "/encode": EncodeRequest}
ROUTES = {**GENERATION, **OTHERS}
# Fields that set how many tokens a request makes: kept small, so that each example is quick.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens")
MAX_NEW = 8

_STRINGS = ["", "a", "hi", " ", "\n", "\U0001f600", "<|im_end|>", "\\d+", "[", "user", "assistant", "system",
            "tool", "auto", "none", "required", "json_object", "json_schema", "text", "function", "m"]
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.sampled_from([2**31, -(2**40), 10**18]),
                 st.floats(-1e6, 1e6), st.sampled_from(_STRINGS), st.lists(st.integers(-2, 60000), max_size=3),
                 st.dictionaries(st.sampled_from(["a", "type", "x"]), st.integers(-2, 2), max_size=2))


def _of_type(t: str) -> st.SearchStrategy[Any]:
    return {
        "integer": st.one_of(st.integers(-2, 8), st.sampled_from([0, 1, 64, 2**31, 10**12, -1])),
        "number": st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1.0, 1e-9, 1e30, -1e30, 2.0])),
        "string": st.one_of(st.sampled_from(_STRINGS), st.text(max_size=6)),
        "boolean": st.booleans(),
        "null": st.none(),
    }[t]


class Bodies:
    """Strategies for the instances of one JSON schema (msgspec's, with its $defs)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.defs = schema.get("$defs", {})
        self.root = schema

    def of(self, s: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
        if "$ref" in s:
            return st.deferred(lambda: self.of(self.defs[s["$ref"].rsplit("/", 1)[1]], depth + 1))
        if "anyOf" in s:
            return st.one_of([self.of(x, depth) for x in s["anyOf"]])
        t = s.get("type")
        if t == "object" and "properties" in s:
            return self._object(s, depth)
        if t == "object":
            values = self.of(s["additionalProperties"], depth + 1) if isinstance(
                s.get("additionalProperties"), dict) else JUNK
            return st.dictionaries(st.one_of(st.sampled_from(["0", "1", "7", "a"]), st.text(max_size=3)), values,
                                   max_size=3)
        if t == "array":
            return st.lists(self.of(s.get("items", {}), depth + 1), max_size=3 if depth < 3 else 1)
        if t is None:  # any value
            return JUNK
        return _of_type(t)

    def _object(self, s: dict[str, Any], depth: int) -> st.SearchStrategy[dict[str, Any]]:
        props: dict[str, Any] = s["properties"]
        required = [k for k in s.get("required", ()) if k in props]
        optional = sorted(set(props) - set(required))

        @st.composite
        def draw(d: Any) -> dict[str, Any]:
            out = {k: d(self.of(props[k], depth + 1)) for k in required}
            few = 4 if depth < 2 else 2
            for k in d(st.lists(st.sampled_from(optional), max_size=few, unique=True)) if optional else []:
                out[k] = d(self.of(props[k], depth + 1))
            if depth <= 1 and out and d(st.integers(0, 14)) == 0:  # now and then, a value of another type
                out[d(st.sampled_from(sorted(out)))] = d(JUNK)
            if depth <= 1 and d(st.integers(0, 39)) == 0:
                out["no_such_field"] = d(JUNK)
            return out

        return draw()

    def bodies(self) -> st.SearchStrategy[dict[str, Any]]:
        return self.of(self.root)


USER = [{"role": "user", "content": "hi"}]


@st.composite
def requests(draw: Any) -> tuple[str, dict[str, Any]]:
    """A route and a body for it; half the bodies start from a valid prompt or conversation
    and a third of them stream, so that requests reach the engine and its streams, not only
    the first check."""
    route = draw(st.sampled_from(sorted(GENERATION) * 2 + sorted(OTHERS)))
    body = draw(Bodies(msgspec.json.schema(ROUTES[route])).bodies())
    if draw(st.integers(0, 2)) == 0:
        body.setdefault("stream", True)
    if draw(st.booleans()):
        prompt = {"/v1/chat/completions": ("messages", USER), "/v1/completions": ("prompt", "hi"),
                  "/tokenize": ("prompt", "hi"), "/detokenize": ("tokens", [1, 2]),
                  "/v1/embeddings": ("input", "hi"), "/encode": ("text", "hi")}.get(route)
        if prompt is not None:
            body[prompt[0]] = prompt[1]
        elif "input_ids" not in body:
            body["text"] = "hi"
    if route in OTHERS:
        return route, body
    if route != "/generate":
        body.setdefault("max_tokens", MAX_NEW)
    else:
        sp = body.get("sampling_params")
        if isinstance(sp, dict):
            sp.setdefault("max_new_tokens", MAX_NEW)
        elif sp is None:
            body["sampling_params"] = {"max_new_tokens": MAX_NEW}
    for holder in (body, body.get("sampling_params")):
        if isinstance(holder, dict):
            for k in LENGTH_FIELDS:
                if isinstance(holder.get(k), int) and holder[k] > MAX_NEW:
                    holder[k] = MAX_NEW
    return route, body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    from sgl.sched.models.default_model import default_model_dir

    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    s = ServerProc("--model-path", default_model_dir(), "--load-format", "null", "--max-total-tokens", "4000",
                   "--context-length", "512", "--log-level", "warning", "--served-model-name", "m",
                   api_key=API_KEY, stderr_path=str(log))
    yield s
    assert s.stop(signal.SIGTERM) == 0


def _check_error(r: Any, route: str, body: dict[str, Any]) -> None:
    assert r.status_code in (400, 404), (r.status_code, r.text, route, body)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert not err["message"].startswith("internal error"), (err, route, body)
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err


def _check_stream(text: str, route: str, body: dict[str, Any]) -> None:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", (text[-300:], route, body)
    for e in events[:-1]:
        item = json.loads(e)
        if isinstance(item, dict) and "error" in item:  # a failure after the 200: an event, never an internal error
            assert not item["error"]["message"].startswith("internal error"), (item, route, body)


def _check_result(out: Any, route: str, body: dict[str, Any]) -> None:
    if route in OTHERS:
        assert isinstance(out, dict), (out, route, body)
    elif route == "/generate":
        for o in out if isinstance(out, list) else [out]:
            assert "meta_info" in o and o["meta_info"]["finish_reason"] is not None, (o, body)
    else:
        assert out["choices"] and all("finish_reason" in c for c in out["choices"]), (out, body)
        assert out["usage"]["completion_tokens"] >= 0, out


@settings(PROFILE, max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])
@given(requests())
def test_any_body_gets_a_shaped_answer(server: ServerProc, request_: tuple[str, dict[str, Any]]) -> None:
    route, body = request_
    r = HTTP.post(server.url + route, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    if r.status_code != 200:
        _check_error(r, route, body)
    elif r.headers["content-type"].startswith("text/event-stream"):
        _check_stream(r.text, route, body)
    else:
        _check_result(r.json(), route, body)


def test_after_the_bodies_the_server_serves_and_balances(server: ServerProc) -> None:
    """Runs after the property above (file order): whatever those requests did, the server
    answers a plain request and every KV slot is back."""
    r = HTTP.post(server.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                  headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    server.assert_balanced()
