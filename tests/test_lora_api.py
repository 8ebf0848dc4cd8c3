"""LoRA adapters from the caller's side (docs/lora.md): the engines' load and unload calls
(arguments checked before anything is sent, replies and refusals, data parallelism, the
sync twin), the adapter a request names (the front end's fast check, batches, attached
clients), SGLang's and vLLM's HTTP routes and bodies, the OpenAI routes' `model` and
`lora_path`, /v1/models, the admin key, and the fake engine's rules.

The fake engine speaks the control plane as the scheduler does; a stand-in scheduler
(tests/test_control_plane_api.py) shows what is sent. No adapter runs on a model here."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import openai
import pytest

import sgl
from sgl.core.protocol import ControlReqOutput, GenerateReqInput, LoadLoraAdapterReq, Message, UnloadLoraAdapterReq
from sgl.engine.lora_adapters import LoraAdapters, UnknownLoraAdapter
from sgl.runtime.dp_router import DataParallelSender
from sgl.runtime.metrics import Metrics
from sgl.runtime.tokenizer_manager import TokenizerManager
from sgl.server.app import build_app
from sgl.testing import FakeEngine
from sgl.testing.fake import run_virtual
from tests.fake_channels import AsyncQueueReceiver
from tests.test_control_plane_api import LIMITS, StandInEngine, StandInScheduler, make_engine

ADAPTERS = ["sql=/adapters/sql", "/adapters/chat"]  # "chat": named by its folder
UNKNOWN = "lora_path: no LoRA adapter named 'nope' is loaded (loaded: chat, sql)"
NO_LORA = "start it with --lora-paths NAME=PATH (adapters loaded at start) or --enable-lora"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def loaded_reply(adapters: dict[str, str]) -> Any:
    """A stand-in scheduler's answer: every call succeeds, listing `adapters`."""
    return lambda msg: ControlReqOutput(success=True, message="ok", data={"loaded_adapters": dict(adapters)})


def spy_requests(engine: FakeEngine) -> list[str | None]:
    """The lora_path of each generate request the fake's scheduler gets from now on."""
    seen: list[str | None] = []
    handle = engine.scheduler.handle

    def spy(msg: Message) -> None:
        if isinstance(msg, GenerateReqInput):
            seen.append(msg.lora_path)
        handle(msg)

    engine.scheduler.handle = spy  # type: ignore[method-assign]
    return seen


# ---- engine methods --------------------------------------------------------------------

BAD_CALLS: list[tuple[str, tuple[Any, ...], str]] = [
    ("load_lora_adapter", ("", "/a"), "lora_name"),
    ("load_lora_adapter", ("has space", "/a"), "lora_name"),
    ("load_lora_adapter", ("x" * 129, "/a"), "lora_name"),
    ("load_lora_adapter", (3, "/a"), "lora_name"),
    ("load_lora_adapter", ("sql", ""), "lora_path"),
    ("load_lora_adapter", ("sql", "  "), "lora_path"),
    ("load_lora_adapter", ("sql", None), "lora_path"),
    ("unload_lora_adapter", ("",), "lora_name"),
    ("unload_lora_adapter", (None,), "lora_name"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("method", "args", "field"), BAD_CALLS, ids=[f"{m}-{f}-{i}" for i, (m, _, f) in
                                                                     enumerate(BAD_CALLS)])
async def test_bad_arguments_name_the_field_and_send_nothing(method: str, args: tuple[Any, ...], field: str) -> None:
    e, sched = make_engine(enable_lora=True)
    try:
        with pytest.raises(ValueError, match=rf"^{field}\b") as err:
            await getattr(e, method)(*args)
        assert getattr(err.value, "field", None) == field
        assert sched.sent == []
    finally:
        await e.aclose()


@pytest.mark.anyio
async def test_load_and_unload_send_their_requests_and_follow_the_replies() -> None:
    e, sched = make_engine(lora_paths=ADAPTERS)
    try:
        assert e.loras.listed() == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
        sched.answer = loaded_reply({"sql": "/adapters/sql", "chat": "/adapters/chat", "tone": "/t"})
        out = await e.load_lora_adapter("tone", "/t")
        assert out == {"success": True, "message": "ok",
                       "loaded_adapters": {"sql": "/adapters/sql", "chat": "/adapters/chat", "tone": "/t"}}
        sched.answer = loaded_reply({"chat": "/adapters/chat", "tone": "/t"})
        await e.unload_lora_adapter("sql")
        assert e.loras.listed() == {"chat": "/adapters/chat", "tone": "/t"}
        assert sched.control == [LoadLoraAdapterReq(lora_name="tone", lora_path="/t", req_id=1),
                                 UnloadLoraAdapterReq(lora_name="sql", req_id=2)]
    finally:
        await e.aclose()


@pytest.mark.anyio
async def test_a_refusal_raises_the_engines_message_and_changes_nothing() -> None:
    e, sched = make_engine(lora_paths=ADAPTERS)
    try:
        sched.answer = lambda m: ControlReqOutput(success=False, message="rank 64 is above max_lora_rank=16")
        with pytest.raises(ValueError, match="^rank 64 is above max_lora_rank=16$"):
            await e.load_lora_adapter("big", "/big")
        assert set(e.loras.listed()) == {"sql", "chat"}
    finally:
        await e.aclose()


@pytest.mark.anyio
async def test_unloading_an_unknown_adapter_asks_the_scheduler_once_then_refuses() -> None:
    e, sched = make_engine(lora_paths=ADAPTERS)
    sched.info = {"lora_adapters": {"sql": "/adapters/sql", "chat": "/adapters/chat"}}
    try:
        with pytest.raises(UnknownLoraAdapter, match=r"^lora_name: no LoRA adapter named 'nope' is loaded "
                                                     r"\(loaded: chat, sql\)$"):
            await e.unload_lora_adapter("nope")
        assert sched.control == [] and len(sched.sent) == 1  # one server info, no unload
    finally:
        await e.aclose()


@pytest.mark.anyio
async def test_without_lora_a_load_is_refused_before_it_is_sent() -> None:
    e, sched = make_engine()
    try:
        with pytest.raises(ValueError, match=re.escape(NO_LORA)):
            await e.load_lora_adapter("sql", "/adapters/sql")
        assert sched.sent == []
    finally:
        await e.aclose()


@pytest.mark.anyio
async def test_under_data_parallelism_every_replica_loads() -> None:
    recv = AsyncQueueReceiver()
    replicas = [StandInScheduler(recv, loaded_reply({"sql": "/s"})) for _ in range(2)]
    tm = TokenizerManager(None, DataParallelSender(list(replicas)), recv, LIMITS)
    e = StandInEngine(sgl.ServerArgs(enable_lora=True), sgl.ServerArgs().model_files("m"), {}, tm, Metrics())
    try:
        assert (await e.load_lora_adapter("sql", "/s"))["loaded_adapters"] == {"sql": "/s"}
        assert [r.control for r in replicas] == [[LoadLoraAdapterReq(lora_name="sql", lora_path="/s", req_id=1)]] * 2
        replicas[1].answer = lambda m: ControlReqOutput(success=False, message="replica 1: no such folder")
        with pytest.raises(ValueError, match="replica 1: no such folder"):
            await e.load_lora_adapter("tone", "/t")
    finally:
        await e.aclose()


@pytest.mark.parametrize("name", ["load_lora_adapter", "unload_lora_adapter"])
def test_the_sync_engine_mirrors_each_method(name: str) -> None:
    ours, theirs = getattr(sgl.Engine, name), getattr(sgl.AsyncEngine, name)
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert theirs is getattr(sgl.AttachedEngine, name)


# ---- the adapter a request names -----------------------------------------------------------

@pytest.mark.anyio
async def test_requests_name_their_adapter_singly_in_batches_and_streams() -> None:
    async with FakeEngine("ok", lora_paths=ADAPTERS) as e:
        seen = spy_requests(e)
        assert (await e.generate("hi", {"max_new_tokens": 2}, lora_path="sql"))["text"] == "ok"
        await e.generate(["a", "b", "c"], {"max_new_tokens": 2}, lora_path=["sql", None, "chat"])
        await e.generate(["a", "b"], {"max_new_tokens": 2}, lora_path="chat")  # one for every prompt
        _ = [c async for c in e.stream("hi", {"max_new_tokens": 2, "n": 2}, lora_path="sql")]
        await e.generate("hi", {"max_new_tokens": 2})
        assert seen == ["sql", "sql", None, "chat", "chat", "chat", "sql", "sql", None]


BAD_REQUESTS: list[tuple[Any, Any, str]] = [  # each message's beginning
    ("hi", "nope", UNKNOWN),
    (["a", "b"], ["sql", "nope"], UNKNOWN),
    (["a", "b"], ["sql"], "lora_path: a batch of 2 needs 2 values, got 1"),
    ("hi", ["sql"], "lora_path=['sql'] is invalid: must be an adapter's name"),
    ("hi", "has space", "lora_path='has space' is invalid"),
    ("hi", 7, "lora_path=7 is invalid"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("prompt", "lora_path", "message"), BAD_REQUESTS)
async def test_a_request_naming_no_loaded_adapter_is_refused_before_it_is_sent(prompt: Any, lora_path: Any,
                                                                               message: str) -> None:
    async with FakeEngine("ok", lora_paths=ADAPTERS) as e:
        seen = spy_requests(e)
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            await e.generate(prompt, lora_path=lora_path)
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            _ = [c async for c in e.stream(prompt, lora_path=lora_path)]
        assert seen == []


@pytest.mark.anyio
async def test_lora_path_on_an_engine_without_lora_says_how_to_start_one() -> None:
    async with FakeEngine("ok") as e:
        with pytest.raises(ValueError, match=re.escape(f"lora_path: this engine serves no LoRA adapters: {NO_LORA}")):
            await e.generate("hi", lora_path="sql")
        assert (await e.generate("hi", lora_path=None))["text"] == "ok"


@pytest.mark.anyio
async def test_an_adapter_another_client_loaded_is_learned_from_the_scheduler() -> None:
    async with FakeEngine("ok", lora_paths=ADAPTERS) as e:
        e.scheduler.control.adapters.loaded["tone"] = "/t"  # as another client's load would
        assert (await e.generate("hi", {"max_new_tokens": 2}, lora_path="tone"))["text"] == "ok"
        assert e.loras.listed()["tone"] == "/t"
        assert await e.lora_adapter_path("tone") == "/t"
        assert await e.lora_adapter_path("nope") is None


@pytest.mark.anyio
async def test_the_scheduler_refuses_what_the_front_end_cannot_check() -> None:
    async with FakeEngine("ok", lora_paths=ADAPTERS) as e:
        e.loras = LoraAdapters(None, None)  # an attached client whose scheduler reports no adapters
        with pytest.raises(ValueError, match=f"^{re.escape(UNKNOWN)}$"):
            await e.generate("hi", lora_path="nope")


def test_an_attached_client_knows_what_the_server_info_says() -> None:
    known = LoraAdapters.of_info({"lora_adapters": {"sql": "/s"}})
    assert known.enabled is None and known.listed() == {"sql": "/s"}
    assert known.requested(["sql", None]) == {"sql"} and known.lacks({"tone"})
    with pytest.raises(UnknownLoraAdapter, match="no LoRA adapter named 'tone'"):
        known.check({"tone"}, "lora_path")
    blind = LoraAdapters.of_info({})
    assert not blind.lacks({"tone"}) and blind.listed() == {}
    blind.check({"tone"}, "lora_path")  # nothing known: the scheduler decides
    blind.learn({"lora_adapters": {"tone": "/t"}})
    assert blind.enabled is True and blind.listed() == {"tone": "/t"}


# ---- the fake engine's rules ------------------------------------------------------------

def test_the_fake_refuses_as_the_scheduler_does() -> None:
    async def main() -> None:
        async with FakeEngine("abcdef", lora_paths=ADAPTERS, max_loaded_loras=3, per_token_s=1.0) as e:
            with pytest.raises(ValueError, match="^lora_name: an adapter named 'sql' is loaded already"):
                await e.load_lora_adapter("sql", "/elsewhere")
            await e.load_lora_adapter("tone", "/t")
            with pytest.raises(ValueError, match="^lora_name: 3 adapters are loaded, as many as max_loaded_loras"):
                await e.load_lora_adapter("more", "/m")
            running = asyncio.create_task(e.generate("hi", {"max_new_tokens": 4}, lora_path="tone"))
            await asyncio.sleep(1.5)
            with pytest.raises(ValueError, match="^lora_name: 1 live requests use the adapter 'tone'"):
                await e.unload_lora_adapter("tone")
            await running
            out = await e.unload_lora_adapter("tone")
            assert out["loaded_adapters"] == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
            assert (await e.get_server_info())["lora_adapters"] == out["loaded_adapters"]

    run_virtual(main())


@pytest.mark.anyio
async def test_the_fake_shares_no_prefix_between_adapters() -> None:
    prompt = "a prompt long enough to be cached " * 4
    async with FakeEngine("ok", lora_paths=ADAPTERS) as e:
        async def cached(lora: str | None) -> int:
            out = await e.generate(prompt, {"max_new_tokens": 2}, lora_path=lora)
            return int(out["meta_info"]["cached_tokens"])

        assert await cached(None) == 0
        assert await cached("sql") == 0  # the base model's KV is no prefix of sql's
        assert await cached("sql") > 0
        assert await cached("chat") == 0
        assert await cached(None) > 0


# ---- HTTP ---------------------------------------------------------------------------------

class Server:
    """sgl serve's app over a fake engine, called in-process."""

    def __init__(self, headers: dict[str, str] | None = None, **args: Any) -> None:
        self.engine = FakeEngine("ok", **args)
        self.app = build_app(self.engine, "base")
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://sgl",
                                        headers=headers or {})
        self.seen = spy_requests(self.engine)

    async def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return await self.client.post(path, json=body, **kw)

    async def close(self) -> None:
        await self.client.aclose()
        await self.engine.aclose()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    s = Server(lora_paths=ADAPTERS)
    yield s
    await s.close()


@pytest.mark.anyio
async def test_sglangs_routes_load_and_unload(server: Server) -> None:
    r = await server.post("/load_lora_adapter", {"lora_name": "tone", "lora_path": "/t", "pinned": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["message"]
    assert body["loaded_adapters"] == {"sql": "/adapters/sql", "chat": "/adapters/chat", "tone": "/t"}
    r = await server.post("/unload_lora_adapter", {"lora_name": "sql"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"chat": "/adapters/chat", "tone": "/t"}


SGLANG_BAD: list[tuple[str, dict[str, Any], str, str | None]] = [
    ("/load_lora_adapter", {"lora_name": "sql", "lora_path": "/other"}, "lora_name", None),  # the fake's refusal
    ("/load_lora_adapter", {"lora_name": "has space", "lora_path": "/a"}, "lora_name", "invalid_value"),
    # The served model's name: `model` would name the base model, never this adapter.
    ("/load_lora_adapter", {"lora_name": "base", "lora_path": "/a"}, "lora_name", "invalid_value"),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": ""}, "lora_path", "invalid_value"),
    ("/load_lora_adapter", {"lora_name": "x"}, "lora_path", "missing_required_parameter"),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/a", "lora_id": "7"}, "lora_id", "unknown_parameter"),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/a", "load_inplace": True}, "load_inplace",
     "unsupported_parameter"),
    ("/unload_lora_adapter", {"lora_name": "nope"}, "lora_name", "invalid_value"),
    ("/unload_lora_adapter", {}, "lora_name", "missing_required_parameter"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body", "param", "code"), SGLANG_BAD,
                         ids=[f"{p}-{f}-{i}" for i, (p, _, f, _) in enumerate(SGLANG_BAD)])
async def test_sglangs_routes_answer_failures_as_400s_in_both_shapes(server: Server, path: str,
                                                                    body: dict[str, Any], param: str,
                                                                    code: str | None) -> None:
    r = await server.post(path, body)
    assert r.status_code == 400, r.text
    out = r.json()
    assert (out["error"]["param"], out["error"]["code"]) == (param, code)
    assert out["success"] is False and out["message"] == out["error"]["message"]
    assert set(server.engine.loras.listed()) == {"sql", "chat"}


@pytest.mark.anyio
async def test_vllms_routes_answer_in_text_and_vllms_statuses(server: Server) -> None:
    r = await server.post("/v1/load_lora_adapter", {"lora_name": "tone", "lora_path": "/t"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'tone' added successfully.")
    assert r.headers["content-type"].startswith("text/plain")
    r = await server.post("/v1/unload_lora_adapter", {"lora_name": "tone"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'tone' removed successfully.")

    r = await server.post("/v1/unload_lora_adapter", {"lora_name": "tone"})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "lora_name: no LoRA adapter named 'tone' is loaded (loaded: chat, sql)",
                                 "type": "not_found_error", "param": "lora_name", "code": "model_not_found"}
    r = await server.post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/other"})
    assert r.status_code == 400 and "loaded already" in r.json()["error"]["message"]
    for body, param in [({"lora_name": "x", "lora_path": "/a", "load_inplace": True}, "load_inplace"),
                        ({"lora_name": "", "lora_path": "/a"}, "lora_name"), ({"lora_name": "x"}, "lora_path")]:
        r = await server.post("/v1/load_lora_adapter", body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), body
    r = await server.post("/v1/unload_lora_adapter", {"lora_name": "sql", "lora_int_id": 1})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_int_id")


@pytest.mark.anyio
@pytest.mark.parametrize(("keys", "control_key"), [({"api_key": "user", "admin_api_key": "root"}, "root"),
                                                   ({"api_key": "user"}, "user")])
async def test_the_adapter_routes_need_the_control_key(keys: dict[str, str], control_key: str) -> None:
    s = Server(lora_paths=ADAPTERS, **keys)
    user, admin = {"Authorization": "Bearer user"}, {"Authorization": f"Bearer {control_key}"}
    try:
        for path, body in [("/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
                           ("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/b"}),
                           ("/unload_lora_adapter", {"lora_name": "a"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "b"})]:
            assert (await s.post(path, body)).status_code == 401, path
            if control_key != "user":
                assert (await s.post(path, body, headers=user)).status_code == 401, path
            assert (await s.post(path, body, headers=admin)).status_code == 200, path
        # Generation keeps the API key, which names adapters like any other field.
        r = await s.post("/generate", {"text": "hi", "lora_path": "sql"}, headers=user)
        assert r.status_code == 200, r.text
    finally:
        await s.close()


@pytest.mark.anyio
async def test_native_generate_takes_a_lora_path_or_one_per_prompt(server: Server) -> None:
    r = await server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "lora_path": "sql"})
    assert r.status_code == 200 and r.json()["text"] == "ok"
    r = await server.post("/generate", {"text": ["a", "b"], "lora_path": ["chat", None]})
    assert r.status_code == 200 and len(r.json()) == 2
    r = await server.post("/generate", {"input_ids": [[1, 2], [3, 4]], "lora_path": ["chat", "sql"], "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert server.seen == ["sql", "chat", None, "chat", "sql"]
    for body in ({"text": "hi", "lora_path": "nope"}, {"text": ["a", "b"], "lora_path": ["sql"]},
                 {"text": "hi", "lora_path": "nope", "stream": True}):
        r = await server.post("/generate", body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path"), body
    assert r.json()["error"]["message"] == UNKNOWN


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body"), [("/v1/completions", completion), ("/v1/chat/completions", chat)])
async def test_openai_routes_run_the_adapter_model_or_lora_path_names(server: Server, path: str, body: Any) -> None:
    for fields, shown in [({"model": "sql"}, "sql"), ({"model": "base", "lora_path": "chat"}, "base"),
                          ({"lora_path": "chat"}, "base"), ({"model": "sql", "lora_path": "sql"}, "sql"),
                          ({"model": "base"}, "base"), ({}, "base")]:
        r = await server.post(path, body(**fields))
        assert r.status_code == 200, (fields, r.text)
        assert r.json()["model"] == shown, fields
    r = await server.post(path, body(model="sql", stream=True, stream_options={"include_usage": True}))
    chunks = [msgspec.json.decode(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"sql"}
    assert server.seen == ["sql", "chat", "chat", "sql", None, None, "sql"]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body"), [("/v1/completions", completion), ("/v1/chat/completions", chat)])
async def test_openai_routes_refuse_unknown_and_disagreeing_adapters(server: Server, path: str, body: Any) -> None:
    r = await server.post(path, body(model="nope"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = await server.post(path, body(model="sql", lora_path="chat"))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "lora_path" and "disagrees with model='sql'" in r.json()["error"]["message"]
    r = await server.post(path, body(lora_path="nope"))
    assert r.status_code == 400 and r.json()["error"]["message"] == UNKNOWN
    assert r.json()["error"]["param"] == "lora_path"
    assert server.seen == []


@pytest.mark.anyio
async def test_lora_path_without_lora_is_a_400_and_an_adapter_model_a_404() -> None:
    s = Server()
    try:
        r = await s.post("/v1/chat/completions", chat(lora_path="sql"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert NO_LORA in r.json()["error"]["message"]
        assert (await s.post("/v1/completions", completion(model="sql"))).status_code == 404
        assert [m["id"] for m in (await s.client.get("/v1/models")).json()["data"]] == ["base"]
    finally:
        await s.close()


@pytest.mark.anyio
async def test_models_lists_each_adapter_after_the_base(server: Server) -> None:
    await server.post("/load_lora_adapter", {"lora_name": "org/tone:v2", "lora_path": "/t"})
    data = (await server.client.get("/v1/models")).json()["data"]
    assert [m["id"] for m in data] == ["base", "sql", "chat", "org/tone:v2"]
    base, sql = data[0], data[1]
    assert {k: sql[k] for k in ("object", "owned_by", "root", "parent", "created")} == {
        "object": "model", "owned_by": "sgl", "root": "/adapters/sql", "parent": "base", "created": base["created"]}
    assert (await server.client.get("/v1/models/org/tone:v2")).json()["root"] == "/t"
    assert (await server.client.get("/v1/models/base")).json()["parent"] is None
    r = await server.client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.anyio
async def test_the_openai_client_names_an_adapter_as_its_model(server: Server) -> None:
    client = openai.AsyncOpenAI(base_url="http://sgl/v1", api_key="none", http_client=server.client)
    assert [m.id for m in (await client.models.list()).data] == ["base", "sql", "chat"]
    r = await client.completions.create(model="sql", prompt="hi", max_tokens=2)
    assert r.model == "sql" and r.choices[0].text == "ok"
    c = await client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, extra_body={"lora_path": "chat"})
    assert c.model == "base"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert server.seen == ["sql", "chat"]
