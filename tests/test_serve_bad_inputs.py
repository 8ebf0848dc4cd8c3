"""Bad input, table-driven, across HTTP (native and OpenAI routes), the Python API
(an AsyncEngine attached over tcp, ServerArgs) and the tcp transport (unsigned,
wrongly signed, short, replayed, malformed, oversized frames). Each case gets a clear
error naming what is wrong; after each the server still answers a request and
its KV accounting balances."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq

import sgl
from sgl.core.protocol import GenerateReqInput
from sgl.core.sampling_params import SamplingParams
from sgl.transports.auth import new_session, sign
from tests.serve_util import HTTP, ServerProc

API_KEY = "sk-bad-inputs"
TRANSPORT_KEY = "5e" * 32
BODY_LIMIT = 100_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    from sgl.sched.models.default_model import default_model_dir

    log = tmp_path_factory.mktemp("bad-inputs") / "server.log"
    s = ServerProc("--model-path", default_model_dir(), "--load-format", "null", "--transport", "tcp",
                   "--transport-key", TRANSPORT_KEY, "--max-total-tokens", "4000",
                   "--max-request-bytes", str(BODY_LIMIT), "--log-level", "warning", "--served-model-name", "m",
                   api_key=API_KEY, stderr_path=str(log))
    s.log_path = log  # type: ignore[attr-defined]
    yield s
    assert s.stop(signal.SIGTERM) == 0


@pytest.fixture(scope="module")
def attached(server: ServerProc) -> Iterator[tuple[asyncio.AbstractEventLoop, sgl.AsyncEngine]]:
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(sgl.AsyncEngine.connect(server.scheduler_address, transport_key=TRANSPORT_KEY))
    yield loop, engine
    loop.run_until_complete(engine.aclose())
    loop.close()


@dataclass(frozen=True)
class Http:
    path: str
    body: Any  # bytes are sent raw, anything else as JSON
    status: int
    says: str  # a piece of the error message
    method: str = "POST"
    auth: str | None = API_KEY
    param: str | None = None  # the error's param, where the case checks it
    code: str | None = None  # the error's OpenAI code, where the case checks it


@dataclass(frozen=True)
class Py:
    call: Callable[[sgl.AsyncEngine], Any]  # sync (raises at once) or returns a coroutine
    says: str


@dataclass(frozen=True)
class Frame:
    make: Callable[[], bytes]
    counter: str  # the scheduler's transport_refused_* count that must go up ("": none); logs say it once per peer
    times: int = 1  # sends of the same frame


def _signed(payload: bytes, key: str = TRANSPORT_KEY) -> bytes:
    """The shared-key format: HMAC tag, a fresh session, sequence number 0, the payload."""
    return sign(bytes.fromhex(key), new_session(), 0, payload)


def _msg(**kw: Any) -> bytes:
    return msgspec.msgpack.encode(GenerateReqInput(kw.pop("rid", "raw"), kw.pop("input_ids", [1]),
                                                   SamplingParams(max_new_tokens=2), **kw))


G = "/generate"
C = "/v1/completions"
CH = "/v1/chat/completions"
SP = {"max_new_tokens": 2}
USER = [{"role": "user", "content": "hi"}]

CASES: dict[str, Http | Py | Frame] = {
    # ---- HTTP: the body itself
    "bad-json": Http(G, b'{"text": "hi"', 400, "not valid JSON"),
    "empty-body": Http(G, b"", 400, "empty"),
    "json-array": Http(G, [1, 2], 400, "Expected `object`"),
    "invalid-utf8": Http(G, b'{"text": "\xff\xfe"}', 400, "not valid JSON"),
    "unknown-field": Http(G, {"text": "hi", "foo": 1}, 400, "unknown field `foo`"),
    "nan-literal": Http(G, b'{"text": "hi", "sampling_params": {"temperature": NaN}}', 400, "not valid JSON"),
    "body-too-large": Http(G, {"text": "x" * (BODY_LIMIT + 10)}, 413, "exceeds the limit"),
    "no-api-key": Http(G, {"text": "hi"}, 401, "API key", auth=None),
    "wrong-api-key": Http(G, {"text": "hi"}, 401, "API key", auth="sk-wrong"),
    "wrong-method": Http(G, None, 405, "Method Not Allowed", method="GET"),
    "unknown-path": Http("/no/such/route", None, 404, "Not Found", method="GET"),
    # ---- HTTP: /generate fields
    "text-wrong-type": Http(G, {"text": 5}, 400, "text"),
    "text-and-ids": Http(G, {"text": "hi", "input_ids": [1]}, 400, "exactly one of text or input_ids", param="text"),
    "no-prompt": Http(G, {"sampling_params": SP}, 400, "exactly one of text or input_ids", param="text"),
    "empty-text": Http(G, {"text": ""}, 400, "empty"),
    "empty-text-batch": Http(G, {"text": []}, 400, "text: an empty batch", param="text"),
    "empty-ids": Http(G, {"input_ids": []}, 400, "empty"),
    "ids-not-ints": Http(G, {"input_ids": ["a"]}, 400, "input_ids"),
    "ids-bool": Http(G, {"input_ids": [1, True]}, 400, "input_ids"),
    "ids-float": Http(G, {"input_ids": [1, 2.0]}, 400, "input_ids"),
    "ids-huge": Http(G, {"input_ids": [1, 2**70]}, 400, "input_ids"),
    "stop-token-bool": Http(G, {"text": "hi", "sampling_params": {"stop_token_ids": [False]}}, 400,
                            "stop_token_ids"),
    "ids-out-of-vocab": Http(G, {"input_ids": [10**9]}, 400, "input_ids"),
    "ids-negative": Http(G, {"input_ids": [-1]}, 400, "input_ids"),
    "ids-too-long": Http(G, {"input_ids": [1] * 9000}, 400, "context length"),
    "text-too-long": Http(G, {"text": "hello " * 9000}, 400, "context length"),
    "sp-not-object": Http(G, {"text": "hi", "sampling_params": "hot"}, 400, "sampling_params"),
    "temperature-negative": Http(G, {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    "top-p-zero": Http(G, {"text": "hi", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    "top-p-above-one": Http(G, {"text": "hi", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
    "top-k-zero": Http(G, {"text": "hi", "sampling_params": {"top_k": 0}}, 400, "top_k"),
    "min-p-two": Http(G, {"text": "hi", "sampling_params": {"min_p": 2}}, 400, "min_p"),
    "max-new-tokens-negative": Http(G, {"text": "hi", "sampling_params": {"max_new_tokens": -5}}, 400,
                                    "max_new_tokens"),
    "max-new-tokens-string": Http(G, {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}, 400,
                                  "max_new_tokens"),
    "sp-unknown-field": Http(G, {"text": "hi", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    "stop-token-negative": Http(G, {"text": "hi", "sampling_params": {"stop_token_ids": [-3]}}, 400,
                                "stop_token_ids"),
    "seed-string": Http(G, {"text": "hi", "sampling_params": {"seed": "abc"}}, 400, "seed"),
    "rid-wrong-type": Http(G, {"text": "hi", "rid": 5}, 400, "rid"),
    "stream-wrong-type": Http(G, {"text": "hi", "stream": "yes"}, 400, "stream"),
    "stream-batch-one-rid": Http(G, {"text": ["a", "b"], "stream": True, "rid": "same"}, 400, "list of rids"),
    "batch-rid-twice": Http(G, {"input_ids": [[1], [2]], "rid": ["x", "x"]}, 400, "the batch names 'x' twice"),
    "stream-batch-sp-count": Http(G, {"input_ids": [[1], [2]], "stream": True, "sampling_params": [SP]}, 400,
                                  "a batch of 2 needs 2"),
    "stream-batch-one-bad-prompt": Http(G, {"input_ids": [[1], [10**9]], "stream": True,
                                            "sampling_params": {"max_new_tokens": 500}}, 400, "input_ids"),
    "return-logprob-string": Http(G, {"text": "hi", "return_logprob": "yes"}, 400, "return_logprob"),
    "return-logprob-list-for-one": Http(G, {"text": "hi", "return_logprob": [True]}, 400, "return_logprob"),
    "logprob-start-len-past-prompt": Http(G, {"input_ids": [1, 2], "return_logprob": True,
                                              "logprob_start_len": 2}, 400, "logprob_start_len=2"),
    "top-logprobs-num-negative": Http(G, {"text": "hi", "return_logprob": True, "top_logprobs_num": -1}, 400,
                                      "top_logprobs_num=-1"),
    "token-ids-logprob-out-of-vocab": Http(G, {"text": "hi", "return_logprob": True,
                                               "token_ids_logprob": [10**7]}, 400, "token_ids_logprob"),
    "text-in-logprobs-int": Http(G, {"text": "hi", "return_text_in_logprobs": 1}, 400, "return_text_in_logprobs"),
    "logprob-list-wrong-length": Http(G, {"input_ids": [[1], [2]], "return_logprob": True,
                                          "top_logprobs_num": [1, 2, 3]}, 400, "top_logprobs_num"),
    "abort-without-rid": Http("/abort_request", {}, 400, "rid"),
    # ---- HTTP: OpenAI routes
    "completion-no-prompt": Http(C, {"model": "m"}, 400, "prompt"),
    "completion-n-0": Http(C, {"model": "m", "prompt": "hi", "n": 0}, 400, "n=0"),
    "completion-max-tokens-negative": Http(C, {"model": "m", "prompt": "hi", "max_tokens": -1}, 400,
                                           "max_tokens=-1", param="max_tokens", code="invalid_value"),
    "chat-max-completion-tokens-negative": Http(CH, {"model": "m", "messages": USER, "max_completion_tokens": -1},
                                                400, "max_completion_tokens=-1", param="max_completion_tokens"),
    "chat-min-tokens-negative": Http(CH, {"model": "m", "messages": USER, "min_tokens": -2}, 400, "min_tokens",
                                     param="min_tokens"),
    "completion-unknown-model": Http(C, {"model": "gpt-4", "prompt": "hi"}, 404, "The model `gpt-4` does not exist",
                                     param="model", code="model_not_found"),
    "chat-unknown-model": Http(CH, {"model": "/some/path", "messages": USER}, 404, "does not exist",
                               code="model_not_found"),
    "model-retrieve-unknown": Http("/v1/models/gpt-4", None, 404, "does not exist", method="GET"),
    "completion-unknown-field-code": Http(C, {"model": "m", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate",
                                          param="frobnicate", code="unknown_parameter"),
    # Unknown message keys go to the template (as vLLM), but a message still needs its role.
    "chat-message-without-role": Http(CH, {"model": "m", "messages": [{"content": "hi", "mood": "sad"}]}, 400,
                                      "role"),
    # ---- HTTP: what is not implemented yet is refused, naming the field
    "chat-functions": Http(CH, {"model": "m", "messages": USER, "functions": [{"name": "f"}]}, 400,
                           "functions is not supported yet", param="functions", code="unsupported_parameter"),
    # ---- HTTP: tool calling, naming the field
    "chat-tools-shape": Http(CH, {"model": "m", "messages": USER, "tools": [{"type": "function", "function": {
        "description": "no name"}}]}, 400, "tools[0].function.name", param="tools", code="invalid_value"),
    "chat-tool-choice-unknown": Http(CH, {"model": "m", "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "'g'",
        param="tool_choice"),
    "chat-parallel-tool-calls": Http(CH, {"model": "m", "messages": USER, "parallel_tool_calls": "yes"}, 400,
                                     "parallel_tool_calls must be a boolean", param="parallel_tool_calls"),
    # ---- HTTP: structured output that cannot be had, naming the field
    "chat-response-format-type": Http(CH, {"model": "m", "messages": USER, "response_format": {"type": "xml"}},
                                      400, "response_format.type='xml' is invalid", param="response_format"),
    "chat-response-format-schema": Http(CH, {"model": "m", "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}}}, 400,
        "response_format.json_schema must be an object", param="response_format"),
    "completion-response-format-and-regex": Http(C, {"model": "m", "prompt": "hi", "regex": "a+", "response_format": {
        "type": "json_object"}}, 400, "response_format cannot be combined with regex", param="response_format"),
    "completion-regex-of-no-text": Http(C, {"model": "m", "prompt": "hi", "regex": "[^\\s\\S]"}, 400,
                                        "regex: the grammar matches no text"),
    # ---- values the engine's own messages cannot carry: a 400, and nothing left open
    "custom-params-huge-int": Http(C, {"model": "m", "prompt": "hi", "max_tokens": 2,
                                       "custom_params": {"a": 10**23}}, 400, "custom_params"),
    "chat-template-kwargs-huge-int": Http(CH, {"model": "m", "messages": USER, "chat_template_kwargs": {"x": 10**23}},
                                          400, "integers must fit in 64 bits"),
    "chat-message-extra-huge-int": Http(CH, {"model": "m", "messages": [{"role": "user", "content": "hi",
                                                                          "extra": 10**23}]},
                                        400, "integers must fit in 64 bits"),
    "chat-response-format-schema-does-not-compile": Http(CH, {"model": "m", "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, 400,
        "response_format: the grammar does not compile", param="response_format"),
    "chat-tool-schema-does-not-compile": Http(CH, {"model": "m", "messages": USER, "tool_choice": "required",
                                                   "tools": [{"type": "function", "function": {
                                                       "name": "f", "parameters": {"type": "bogus"}}}]}, 400,
                                              "tools: the grammar does not compile", param="tools"),
    "logit-bias-key-not-an-id": Http(C, {"model": "m", "prompt": "hi", "logit_bias": {"abc": 1}}, 400,
                                     "logit_bias", param="logit_bias"),
    "reasoning-end-id-out-of-vocab": Http(G, {"input_ids": [1], "sampling_params": {
        "max_new_tokens": 2, "regex": "a+", "reasoning_end_id": 10**9}}, 400, "reasoning_end_id=1000000000 is out of "
        "the vocabulary", param="reasoning_end_id"),
    "beam-width-negative": Http(C, {"model": "m", "prompt": "hi", "max_tokens": 2, "beam_width": -1}, 400,
                                "beam_width=-1 is invalid", param="beam_width"),
    "trie-name-never-kept": Http(G, {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "constraint": {
        "type": "trie", "name": "nonexistent"}}}, 400, "no trie is kept under 'nonexistent'"),
    "completion-regex": Http(C, {"model": "m", "prompt": "hi", "regex": "(unclosed"}, 400,
                             "regex: the grammar does not compile"),
    "chat-json-schema": Http(CH, {"model": "m", "messages": USER, "json_schema": "{not json"}, 400,
                             "json_schema: the grammar does not compile"),
    "chat-ebnf": Http(CH, {"model": "m", "messages": USER, "ebnf": "root ::= undefined_rule"}, 400,
                      "ebnf: the grammar does not compile"),
    "chat-two-grammars": Http(CH, {"model": "m", "messages": USER, "ebnf": "root ::= 'a'", "regex": "a"}, 400,
                              "alone: json_schema, regex and ebnf exclude each other"),
    "chat-lora": Http(CH, {"model": "m", "messages": USER, "lora_path": "adapter"}, 400, "lora_path"),
    "chat-hidden-states": Http(CH, {"model": "m", "messages": USER, "return_hidden_states": True}, 400,
                               "return_hidden_states is not supported yet"),
    "chat-audio-modality": Http(CH, {"model": "m", "messages": USER, "modalities": ["text", "audio"]}, 400,
                                "modalities"),
    "chat-template-kwargs-reserved": Http(CH, {"model": "m", "messages": USER,
                                               "chat_template_kwargs": {"tokenize": True}}, 400, "tokenize",
                                          param="chat_template_kwargs"),
    "chat-template-kwargs-not-object": Http(CH, {"model": "m", "messages": USER, "chat_template_kwargs": [1]}, 400,
                                            "chat_template_kwargs"),
    # ---- HTTP: /tokenize, /detokenize
    "tokenize-nothing": Http("/tokenize", {}, 400, "exactly one of prompt and messages"),
    "tokenize-both": Http("/tokenize", {"prompt": "a", "messages": USER}, 400, "exactly one"),
    "tokenize-prompt-int": Http("/tokenize", {"prompt": 5}, 400, "prompt"),
    "tokenize-unknown-model": Http("/tokenize", {"model": "x", "prompt": "a"}, 404, "does not exist"),
    "tokenize-unknown-field": Http("/tokenize", {"prompt": "a", "text": "b"}, 400, "unknown field `text`"),
    "detokenize-strings": Http("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    "detokenize-bool": Http("/detokenize", {"tokens": [1, True]}, 400, "tokens"),
    "detokenize-out-of-vocab": Http("/detokenize", {"tokens": [10**9]}, 400, "tokens: ids must lie in"),
    "detokenize-ragged": Http("/detokenize", {"tokens": [[1], 2]}, 400, "tokens"),
    "completion-temperature-string": Http(C, {"model": "m", "prompt": "hi", "temperature": "hot"}, 400,
                                          "temperature"),
    "completion-unknown-field": Http(C, {"model": "m", "prompt": "hi", "frobnicate": True}, 400, "frobnicate"),
    "completion-empty-prompt-list": Http(C, {"model": "m", "prompt": []}, 400, "prompt"),
    "completion-mixed-prompt": Http(C, {"model": "m", "prompt": [1, "a"]}, 400, "prompt"),
    "completion-logprobs-21": Http(C, {"model": "m", "prompt": "hi", "logprobs": 21}, 400, "logprobs=21"),
    "completion-logprobs-negative": Http(C, {"model": "m", "prompt": "hi", "logprobs": -1}, 400, "logprobs=-1"),
    "completion-logprobs-bool": Http(C, {"model": "m", "prompt": "hi", "logprobs": True}, 400, "logprobs"),
    "completion-suffix": Http(C, {"model": "m", "prompt": "hi", "suffix": "!"}, 400, "suffix is not supported"),
    "completion-best-of-2": Http(C, {"model": "m", "prompt": "hi", "best_of": 2}, 400, "best_of=2 is not supported"),
    "completion-empty-string": Http(C, {"model": "m", "prompt": ""}, 400, "empty"),
    "completion-stream-batch-rid": Http(C, {"model": "m", "prompt": ["a", "b"], "stream": True, "rid": "r"}, 400,
                                        "batch of prompts takes no rid"),
    "completion-stream-batch-bad-prompt": Http(C, {"model": "m", "prompt": [[1], [10**9]], "stream": True}, 400,
                                               "prompt[1][0]=1000000000 is out of the vocabulary", param="prompt"),
    "chat-no-messages": Http(CH, {"model": "m", "messages": []}, 400, "messages"),
    "chat-missing-messages": Http(CH, {"model": "m"}, 400, "messages"),
    "chat-bad-role": Http(CH, {"model": "m", "messages": [{"role": 7, "content": "hi"}]}, 400, "role"),
    "chat-empty-role": Http(CH, {"model": "m", "messages": [{"role": "", "content": "hi"}]}, 400, "role"),
    "chat-image-part": Http(CH, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "text content"),
    "chat-bad-stream-options": Http(CH, {"model": "m", "messages": USER, "stream": True,
                                         "stream_options": {"include_usage": True, "extra": 1}}, 400, "extra"),
    "chat-top-p-zero": Http(CH, {"model": "m", "messages": USER, "top_p": 0}, 400, "top_p"),
    "chat-min-p-negative": Http(CH, {"model": "m", "messages": USER, "min_p": -0.5}, 400, "min_p"),
    "chat-top-logprobs-without-logprobs": Http(CH, {"model": "m", "messages": USER, "top_logprobs": 2}, 400,
                                               "top_logprobs needs logprobs=true"),
    "chat-top-logprobs-21": Http(CH, {"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
                                 "top_logprobs=21"),
    "chat-logprobs-int": Http(CH, {"model": "m", "messages": USER, "logprobs": 3}, 400, "logprobs"),
    # ---- sizes a request may ask for are bounded (each of these once grew or stalled the server)
    "completion-n-2-70": Http(C, {"model": "m", "prompt": "Hi", "max_tokens": 1, "n": 2**70}, 400, "n="),
    "completion-n-100000": Http(C, {"model": "m", "prompt": "Hi", "max_tokens": 1, "n": 100000}, 400, "n=100000"),
    "top-logprobs-num-huge": Http(G, {"text": "hi", "return_logprob": True, "top_logprobs_num": 1000000}, 400,
                                  "top_logprobs_num=1000000"),
    "stop-string-20k-chars": Http(G, {"text": "hi", "sampling_params": {"stop": "x" * 20000}}, 400, "stop"),
    "stop-100-strings": Http(G, {"text": "hi", "sampling_params": {"stop": ["ab"] * 100}}, 400, "stop"),
    "logit-bias-5000": Http(C, {"model": "m", "prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(5000)}},
                            400, "logit_bias"),
    "seed-2-70": Http(G, {"text": "hi", "sampling_params": {"seed": 2**70}}, 400, "seed"),
    "top-k-2-64": Http(G, {"text": "hi", "sampling_params": {"top_k": 2**64}}, 400, "top_k"),
    "max-tokens-2-70": Http(C, {"model": "m", "prompt": "hi", "max_tokens": 2**70}, 400, "max_tokens"),
    "max-tokens-past-context": Http(C, {"model": "m", "prompt": "hi", "max_tokens": 100000}, 400, "context length"),
    "max-tokens-past-kv-pool": Http(G, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, 400,
                                    "can never fit the KV cache"),
    # ---- Python API (an AsyncEngine attached over tcp; ServerArgs)
    "py-prompt-int": Py(lambda e: e.generate(5), "prompt must be a str"),
    "py-empty-ids": Py(lambda e: e.generate(input_ids=[]), "empty"),
    "py-temperature-string": Py(lambda e: e.generate("hi", {"temperature": "x"}), "temperature"),
    "py-prompt-and-ids": Py(lambda e: e.generate("hi", input_ids=[1]), "exactly one"),
    "py-batch-one-rid": Py(lambda e: e.generate(input_ids=[[1], [2]], rid="same"), "rid"),
    "py-sp-list-for-one": Py(lambda e: e.generate("hi", [SP, SP]), "sampling_params"),
    "py-ids-out-of-vocab": Py(lambda e: e.generate(input_ids=[1, 10**7]), "input_ids"),
    "py-server-args-port": Py(lambda e: sgl.ServerArgs.from_kwargs(port=70000), "port"),
    "py-server-args-key": Py(lambda e: sgl.ServerArgs.from_kwargs(transport_key="zz"), "transport_key"),
    "py-server-args-type": Py(lambda e: sgl.ServerArgs.from_kwargs(max_total_tokens="many"), "max_total_tokens"),
    "py-connect-not-tcp": Py(lambda e: sgl.AsyncEngine.connect("ipc:///tmp/x"), "scheduler_address"),
    "py-listen-public-unkeyed": Py(lambda e: __import__("sgl.transports.factory", fromlist=["x"]).open_receiver(
        "tcp://0.0.0.0:0"), "without keys.*sgl keys new DIR"),
    # ---- tcp transport frames sent straight at the scheduler
    "tcp-unsigned": Frame(lambda: _msg(), "transport_refused_auth"),
    "tcp-wrong-key": Frame(lambda: _signed(_msg(), "77" * 32), "transport_refused_auth"),
    "tcp-old-format": Frame(lambda: hmac.new(bytes.fromhex(TRANSPORT_KEY), _msg(), hashlib.sha256).digest() + _msg(),
                            "transport_refused_auth"),  # signed, but without session and sequence number
    "tcp-short": Frame(lambda: b"abc", "transport_refused_auth"),
    "tcp-replayed": Frame(lambda: _signed(_msg(rid="raw-replay")), "transport_refused_replay", times=3),
    "tcp-signed-garbage": Frame(lambda: _signed(b"\xc1\xc1 not msgpack"), "transport_refused_malformed"),
    "tcp-signed-unknown-tag": Frame(lambda: _signed(msgspec.msgpack.encode({"type": "nope"})),
                                    "transport_refused_malformed"),
    "tcp-signed-wrong-types": Frame(lambda: _signed(msgspec.msgpack.encode(
        {"type": "generate", "rid": 1, "input_ids": "x", "sampling_params": {}})), "transport_refused_malformed"),
    "tcp-signed-out-of-vocab": Frame(lambda: _signed(_msg(rid="raw-oov", input_ids=[10**7])), ""),
    "tcp-oversized": Frame(lambda: _signed(b"\x00" * (64 * 1024 * 1024 + 128)), "transport_refused_malformed"),
}


def _check_serving(server: ServerProc) -> None:
    r = server.post(G, json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, server: ServerProc, attached: tuple[asyncio.AbstractEventLoop, sgl.AsyncEngine]) -> None:
    case = CASES[name]
    if isinstance(case, Http):
        headers = {"Authorization": f"Bearer {case.auth}"} if case.auth else {}
        kw: dict[str, Any] = {"content": case.body} if isinstance(case.body, bytes) else (
            {} if case.body is None else {"json": case.body})
        r = HTTP.request(case.method, server.url + case.path, headers=headers, timeout=30, **kw)
        assert r.status_code == case.status, (r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] is None or isinstance(err["code"], str), err  # OpenAI's codes: a string or null
        assert case.says in err["message"], err
        assert case.param is None or err["param"] == case.param, err
        assert case.code is None or err["code"] == case.code, err
    elif isinstance(case, Py):
        loop, engine = attached
        with pytest.raises(ValueError, match=case.says):
            out = case.call(engine)
            if asyncio.iscoroutine(out):
                loop.run_until_complete(out)
    else:
        before = server.info()[case.counter] if case.counter else 0
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(server.scheduler_address)
        frame = case.make()
        for _ in range(case.times):
            sock.send(frame)
        sock.close()
        if case.counter:
            _wait_for_count(server, case.counter, before + case.times - (case.counter == "transport_refused_replay"))
    _check_serving(server)
    server.assert_balanced()


def _wait_for_count(server: ServerProc, counter: str, least: float, timeout: float = 10.0) -> None:
    """Until the scheduler's `counter` (get_server_info) reaches `least`."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.info()[counter] >= least:
            return
        time.sleep(0.05)
    raise AssertionError(f"{counter} never reached {least}")


def test_case_count() -> None:
    assert len(CASES) >= 40
