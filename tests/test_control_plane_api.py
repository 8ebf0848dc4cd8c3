"""The control plane from the caller's side (docs/control.md): the engine methods check
their arguments (errors name the field; nothing bad is sent), send SGLang's requests
and return SGLang's replies; the HTTP routes take SGLang's bodies (extra fields of
SGLang's accepted, unknown ones and pickles refused) and answer 400s in OpenAI's shape
plus SGLang's keys; the admin key guards them; attached tcp clients need an admin key;
data-parallel replies merge; the sync Engine mirrors every method.

A stand-in scheduler answers every request at once (as the real one's ControlReqOutput);
the scheduler side itself is tested end to end elsewhere."""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import pytest

import sgl
from sgl.core.protocol import (
    CONTROL_PLANE,
    AbortAllReq,
    ContinueGenerationReq,
    ControlReqOutput,
    CudaIpcHandle,
    DestroyWeightsUpdateGroupReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    GetWeightsByNameReq,
    InitWeightsUpdateGroupReq,
    LoadLoraAdapterReq,
    Message,
    PauseGenerationReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    SharedTensors,
    TensorEntry,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
)
from sgl.core.request_checks import RequestLimits
from sgl.core.server_args import ModelFiles, ServerArgs, redacted
from sgl.engine.front_end import EngineFrontEnd
from sgl.runtime.dp_router import DataParallelSender, merge_replies
from sgl.runtime.identity import client_id_of, scheduler_policy
from sgl.runtime.metrics import Metrics
from sgl.runtime.tokenizer_manager import TokenizerManager
from sgl.server.app import build_app
from sgl.transports.channel import Peer, Sender
from sgl.transports.keys import KeySet, new_pair
from tests.fake_channels import AsyncQueueReceiver, ListSender

LIMITS = RequestLimits(vocab_size=100, context_length=64, max_total_tokens=64, has_tokenizer=False)
SPEC = SharedTensors(entries=[TensorEntry("model.norm.weight", "float32", [4], 0)], nbytes=16,
                     cuda=CudaIpcHandle(0, b"\x00\xffhandle", 16, 0, b"\x01ref", 0, b"\x02event", True))
Answer = Callable[[Message], ControlReqOutput]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class StandInScheduler(Sender):
    """Answers each request as it is sent, through the manager's receiver: control-plane
    requests as `answer` says (success by default), server info with `info`."""

    def __init__(self, recv: AsyncQueueReceiver, answer: Answer | None = None) -> None:
        self.recv = recv
        self.answer = answer or (lambda msg: ControlReqOutput(success=True))
        self.info: dict[str, Any] = {"weight_version": "v7"}
        self.sent: list[Message] = []

    def send(self, msg: Message) -> None:
        self.sent.append(msg)
        reply: Any = None
        if isinstance(msg, CONTROL_PLANE):
            reply = self.answer(msg)
        elif isinstance(msg, GetServerInfoReq):
            reply = GetServerInfoReqOutput(info=self.info)
        elif isinstance(msg, FlushCacheReq):
            reply = FlushCacheReqOutput(success=True)
        if reply is not None:
            self.recv.q.put_nowait(msgspec.structs.replace(reply, origin=msg.origin, req_id=msg.req_id))  # type: ignore[union-attr]

    @property
    def control(self) -> list[Message]:
        return [m for m in self.sent if isinstance(m, CONTROL_PLANE)]

    def close(self) -> None:
        pass


class StandInEngine(EngineFrontEnd):
    """The engine front end over a StandInScheduler."""

    @property
    def tokenizer(self) -> Any:
        return None

    def _stop(self) -> None:
        pass


def make_engine(answer: Answer | None = None, client_id: str = "", **args: Any) -> tuple[StandInEngine,
                                                                                         StandInScheduler]:
    recv = AsyncQueueReceiver()
    sched = StandInScheduler(recv, answer)
    tm = TokenizerManager(None, sched, recv, LIMITS, client_id=client_id)
    info = {"context_length": 64, "vocab_size": 100}
    return StandInEngine(ServerArgs(**args), ModelFiles("m", "m"), info, tm, Metrics()), sched


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[StandInEngine, StandInScheduler]]:
    e, sched = make_engine()
    yield e, sched
    await e.aclose()


# ---- engine methods: argument checks --------------------------------------------------

TENSORISH = types.SimpleNamespace(shape=(1,), dtype=None, device=None)  # what the checks ask of a tensor
BAD_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any], str]] = [
    ("pause_generation", ("sideways",), {}, "mode"),
    ("pause_generation", (), {"refuse_new": "yes"}, "refuse_new"),
    ("abort", (), {}, "rid"),
    ("abort", ("",), {}, "rid"),
    ("abort", ("r",), {"abort_all": 1}, "abort_all"),
    ("update_weights_from_disk", ("",), {}, "model_path"),
    ("update_weights_from_disk", (None,), {}, "model_path"),
    ("update_weights_from_disk", ("/ckpt", "pickle"), {}, "load_format"),
    ("update_weights_from_disk", ("/ckpt",), {"flush_cache": None}, "flush_cache"),
    ("update_weights_from_disk", ("/ckpt",), {"abort_all_requests": "no"}, "abort_all_requests"),
    ("update_weights_from_disk", ("/ckpt",), {"weight_version": ""}, "weight_version"),
    ("update_weights_from_disk", ("/ckpt",), {"weight_version": 3}, "weight_version"),
    ("update_weights_from_tensor", ([],), {}, "named_tensors"),
    ("update_weights_from_tensor", ([("a", TENSORISH), ("a", TENSORISH)],), {}, "named_tensors"),
    ("update_weights_from_tensor", ([("x", 5)],), {}, "named_tensors"),  # not a tensor
    ("update_weights_from_tensor", ([("a", 1, 2)],), {}, "named_tensors"),
    ("update_weights_from_tensor", ({"": 1},), {}, "named_tensors"),
    ("update_weights_from_tensor", (SPEC,), {"load_format": "direct"}, "load_format"),
    ("update_weights_from_tensor", (SharedTensors(entries=[], nbytes=0),), {}, "named_tensors"),
    ("init_weights_update_group", ("", 29500, 1, 2), {}, "master_address"),
    ("init_weights_update_group", ("10.0.0.1", 70000, 1, 2), {}, "master_port"),
    ("init_weights_update_group", ("10.0.0.1", 0, 1, 2), {}, "master_port"),
    ("init_weights_update_group", ("10.0.0.1", 29500, 0, 2), {}, "rank_offset"),
    ("init_weights_update_group", ("10.0.0.1", 29500, 2, 2), {}, "rank_offset"),
    ("init_weights_update_group", ("10.0.0.1", 29500, 1, 1), {}, "world_size"),
    ("init_weights_update_group", ("10.0.0.1", 29500, 1, 2, ""), {}, "group_name"),
    ("init_weights_update_group", ("10.0.0.1", 29500, 1, 2), {"backend": "mpi"}, "backend"),
    ("update_weights_from_distributed", (["a", "b"], ["float32"], [[2], [2]]), {}, "names"),
    ("update_weights_from_distributed", ([], [], []), {}, "names"),
    ("update_weights_from_distributed", (["a", "a"], ["float32"] * 2, [[2], [2]]), {}, "names"),
    ("update_weights_from_distributed", (["a"], ["int4"], [[2]]), {}, "dtypes"),
    ("update_weights_from_distributed", (["a"], ["float32"], [[-1]]), {}, "shapes"),
    ("update_weights_from_distributed", (["a"], ["float32"], [2]), {}, "shapes"),
    ("update_weights_from_distributed", (["a"], ["float32"], [[2]]), {"group_name": ""}, "group_name"),
    ("destroy_weights_update_group", ("",), {}, "group_name"),
    ("get_weights_by_name", ("",), {}, "name"),
    ("get_weights_by_name", ("w", -1), {}, "truncate_size"),
    ("get_weights_by_name", ("w", 1 << 30), {}, "truncate_size"),
    ("get_weights_by_name", ("w", True), {}, "truncate_size"),
    ("release_memory_occupation", (["gpu"],), {}, "tags"),
    ("release_memory_occupation", ([],), {}, "tags"),
    ("resume_memory_occupation", (["weights", "weights"],), {}, "tags"),
    ("resume_memory_occupation", ("weights",), {}, "tags"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("method", "args", "kwargs", "field"), BAD_CALLS,
                         ids=[f"{m}-{f}-{i}" for i, (m, _, _, f) in enumerate(BAD_CALLS)])
async def test_bad_arguments_raise_value_errors_naming_the_field_and_send_nothing(
        stand_in: tuple[StandInEngine, StandInScheduler], method: str, args: tuple[Any, ...],
        kwargs: dict[str, Any], field: str) -> None:
    e, sched = stand_in
    with pytest.raises(ValueError, match=rf"^[^=:]*\b{field}\b") as err:
        await getattr(e, method)(*args, **kwargs)
    assert getattr(err.value, "field", field) == field
    assert sched.sent == []


# ---- engine methods: what they send and return -----------------------------------------

@pytest.mark.anyio
async def test_each_method_sends_its_request_and_returns_sglangs_reply(
        stand_in: tuple[StandInEngine, StandInScheduler]) -> None:
    e, sched = stand_in
    data: dict[type, dict[str, Any]] = {
        PauseGenerationReq: {"num_paused_requests": 2}, AbortAllReq: {"aborted": 3},
        UpdateWeightsFromDiskReq: {"num_paused_requests": 0, "weight_version": "step-1"},
        GetWeightsByNameReq: {"parameter": [0.5, -1.0]},
    }
    sched.answer = lambda m: ControlReqOutput(success=True, message="done", data=data.get(type(m), {}))

    assert await e.pause_generation("retract") == {"success": True, "message": "done", "num_paused_requests": 2}
    assert await e.continue_generation() == {"success": True, "message": "done"}
    assert await e.abort_all() == 3
    await e.abort(abort_all=True)
    await e.abort("ignored when abort_all", abort_all=True)
    out = await e.update_weights_from_disk("/ckpt", "safetensors", flush_cache=False, weight_version="step-1")
    assert out == {"success": True, "message": "done", "num_paused_requests": 0, "weight_version": "step-1"}
    assert (await e.update_weights_from_tensor(SPEC, abort_all_requests=True))["success"]
    assert (await e.init_weights_update_group("10.0.0.1", 29500, 1, 3, backend="gloo"))["success"]
    await e.update_weights_from_distributed(["w"], ["torch.bfloat16"], [[2, 3]], group_name="g")
    await e.destroy_weights_update_group("g")
    assert await e.get_weights_by_name("model.norm.weight", 2) == [0.5, -1.0]
    await e.release_memory_occupation(["kv_cache"])
    await e.resume_memory_occupation()
    assert await e.get_weight_version() == "v7"

    assert sched.control == [
        PauseGenerationReq(mode="retract", req_id=1), ContinueGenerationReq(req_id=2), AbortAllReq(req_id=3),
        AbortAllReq(req_id=4), AbortAllReq(req_id=5),
        UpdateWeightsFromDiskReq(model_path="/ckpt", load_format="safetensors", flush_cache=False,
                                 weight_version="step-1", req_id=6),
        UpdateWeightsFromTensorReq(tensors=SPEC, abort_all_requests=True, req_id=7),
        InitWeightsUpdateGroupReq(master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3,
                                  backend="gloo", req_id=8),
        UpdateWeightsFromDistributedReq(names=["w"], dtypes=["bfloat16"], shapes=[[2, 3]], group_name="g",
                                        req_id=9),
        DestroyWeightsUpdateGroupReq(group_name="g", req_id=10),
        GetWeightsByNameReq(name="model.norm.weight", truncate_size=2, req_id=11),
        ReleaseMemoryReq(tags=["kv_cache"], req_id=12), ResumeMemoryReq(tags=None, req_id=13),
    ]


@pytest.mark.anyio
async def test_a_refusal_raises_the_schedulers_message(stand_in: tuple[StandInEngine, StandInScheduler]) -> None:
    e, sched = stand_in
    sched.answer = lambda m: ControlReqOutput(success=False, message="no parameter named 'w'")
    with pytest.raises(ValueError, match="^no parameter named 'w'$"):
        await e.get_weights_by_name("w")
    with pytest.raises(ValueError, match="no parameter"):
        await e.update_weights_from_disk("/ckpt")


class FakeBuffer:
    def __init__(self, items: list[tuple[str, Any]]) -> None:
        self.items = items
        self.spec = SPEC
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.anyio
async def test_named_tensors_are_packed_for_the_call_and_freed_after_it(
        stand_in: tuple[StandInEngine, StandInScheduler], monkeypatch: pytest.MonkeyPatch) -> None:
    e, sched = stand_in
    A, B = (types.SimpleNamespace(shape=(k,), dtype=None, device=None) for k in (1, 2))  # tensor-shaped
    made: list[FakeBuffer] = []
    weights = types.ModuleType("sgl.transports.tensors")
    weights.share_tensors = lambda items: made.append(FakeBuffer(items)) or made[-1]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sgl.transports.tensors", weights)

    assert (await e.update_weights_from_tensor({"a": A, "b": B}, weight_version="t1"))["success"]
    assert made[0].items == [("a", A), ("b", B)] and made[0].closed
    assert sched.control == [UpdateWeightsFromTensorReq(tensors=SPEC, weight_version="t1", req_id=1)]
    sched.answer = lambda m: ControlReqOutput(success=False, message="shape mismatch")
    with pytest.raises(ValueError, match="shape mismatch"):
        await e.update_weights_from_tensor([("a", A)])
    assert made[1].closed
    with pytest.raises(ValueError, match="weight_version"):
        await e.update_weights_from_tensor([("a", A)], weight_version="")
    assert len(made) == 2  # options are checked before anything is packed


@pytest.mark.anyio
async def test_weight_calls_wait_longer_than_pause_and_an_attached_timeout_names_the_admin_key() -> None:
    recv = AsyncQueueReceiver()
    tm = TokenizerManager(None, ListSender(), recv, LIMITS, control_timeout=0.05, weights_timeout=0.2,
                          client_id="c1")
    try:
        with pytest.raises(TimeoutError, match=r"PauseGenerationReq: no ControlReqOutput within 0.05 s.*admin key"):
            await tm.control_plane(PauseGenerationReq())
        with pytest.raises(TimeoutError, match=r"UpdateWeightsFromDiskReq: no ControlReqOutput within 0.2 s"):
            await tm.control_plane(UpdateWeightsFromDiskReq(model_path="/ckpt"))
        assert tm.control.pending == {}
    finally:
        recv.close()
        await tm.close()


# ---- data parallelism, the sync engine, server args --------------------------------------

def test_dp_merges_control_replies() -> None:
    ok = ControlReqOutput(success=True, message="ok", data={"aborted": 2, "weight_version": "v2"}, req_id=4)
    first_no = ControlReqOutput(success=False, message="replica 1: out of memory", data={"aborted": 1}, req_id=4)
    second_no = ControlReqOutput(success=False, message="replica 2: out of memory", req_id=4)
    merged = DataParallelSender([ListSender(), ListSender(), ListSender()]).merge([ok, first_no, second_no])
    assert merged == ControlReqOutput(success=False, message="replica 1: out of memory",
                                      data={"aborted": 3, "weight_version": "v2"}, req_id=4)
    assert merge_replies([ok, ok]) == msgspec.structs.replace(ok, data={"aborted": 4, "weight_version": "v2"})


CONTROL_METHODS = ("pause_generation", "continue_generation", "abort_all", "abort", "update_weights_from_disk",
                   "update_weights_from_tensor", "init_weights_update_group", "update_weights_from_distributed",
                   "destroy_weights_update_group", "get_weights_by_name", "release_memory_occupation",
                   "resume_memory_occupation", "get_weight_version", "load_lora_adapter", "unload_lora_adapter")


@pytest.mark.parametrize("name", CONTROL_METHODS)
def test_the_sync_engine_mirrors_each_method(name: str) -> None:
    ours, theirs = getattr(sgl.Engine, name), getattr(sgl.AsyncEngine, name)
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert inspect.iscoroutinefunction(theirs) and not inspect.iscoroutinefunction(ours)
    assert theirs is getattr(sgl.AttachedEngine, name)
    assert (theirs.__doc__ or "").strip()


def test_admin_api_key_is_a_secret_server_arg() -> None:
    from sgl.cli import build_parser

    with pytest.raises(ValueError, match="admin_api_key"):
        ServerArgs(admin_api_key="")
    assert redacted(ServerArgs(admin_api_key="root"))["admin_api_key"] == "<redacted>"
    ns = build_parser().parse_args(["serve", "--admin-api-key", "root"])
    assert ns.admin_api_key == "root"


# ---- attached clients over tcp: the scheduler's policy ----------------------------------

SAMPLES: list[Any] = [
    PauseGenerationReq(mode="retract"), ContinueGenerationReq(), AbortAllReq(),
    UpdateWeightsFromDiskReq(model_path="/ckpt"), UpdateWeightsFromTensorReq(tensors=SPEC),
    InitWeightsUpdateGroupReq(master_address="h", master_port=1, rank_offset=1, world_size=2),
    UpdateWeightsFromDistributedReq(names=["w"], dtypes=["float32"], shapes=[[1]]),
    DestroyWeightsUpdateGroupReq(), GetWeightsByNameReq(name="w"), ReleaseMemoryReq(), ResumeMemoryReq(),
    LoadLoraAdapterReq(lora_name="sql", lora_path="/adapters/sql"), UnloadLoraAdapterReq(lora_name="sql"),
]


def test_samples_cover_the_control_plane() -> None:
    assert {type(m) for m in SAMPLES} == set(CONTROL_PLANE)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_control_plane_request_needs_an_admin_key_and_the_senders_origin(msg: Any) -> None:
    server, alice, root = new_pair(), new_pair(), new_pair()
    check = scheduler_policy(KeySet(server, clients=(alice.public,), admins=(root.public,)))
    own = client_id_of(alice.public), client_id_of(root.public)

    refused = check(msgspec.structs.replace(msg, origin=own[0]), Peer(alice.public))
    assert refused == f"{type(msg).__name__} needs an admin key; client {own[0]} has none"
    assert check(msgspec.structs.replace(msg, origin=own[1]), Peer(root.public)) is None
    assert "asked for a reply to" in str(check(msgspec.structs.replace(msg, origin=own[0]), Peer(root.public)))
    assert check(msg, Peer(server.public)) is None  # the engine's own tokenizer manager


# ---- HTTP ---------------------------------------------------------------------------------

class Http:
    """sgl serve's app over a stand-in engine, called in-process."""

    def __init__(self, answer: Answer | None = None, headers: dict[str, str] | None = None, **args: Any) -> None:
        self.engine, self.sched = make_engine(answer, **args)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(self.engine, "m")),
                                        base_url="http://sgl", headers=headers or {})

    async def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return await self.client.post(path, json=body, **kw) if body is not None else await self.client.post(
            path, **kw)

    async def close(self) -> None:
        await self.client.aclose()
        await self.engine.aclose()


@pytest.fixture
async def http() -> AsyncIterator[Http]:
    h = Http()
    yield h
    await h.close()


GROUP = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
DIST = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}
BAD_BODIES: list[tuple[str, dict[str, Any], str, str]] = [
    ("/pause_generation", {"mode": "sideways"}, "mode", "invalid_value"),
    ("/pause_generation", {"mode": "abort", "force": True}, "force", "unknown_parameter"),
    ("/continue_generation", {"now": True}, "now", "unknown_parameter"),
    ("/update_weights_from_disk", {"model_path": ""}, "model_path", "invalid_value"),
    ("/update_weights_from_disk", {}, "model_path", "missing_required_parameter"),
    ("/update_weights_from_disk", {"model_path": "/c", "load_format": "pickle"}, "load_format", "invalid_value"),
    ("/update_weights_from_disk", {"model_path": "/c", "weight_version": ""}, "weight_version", "invalid_value"),
    ("/update_weights_from_disk", {"model_path": "/c", "manifest": {}}, "manifest", "unknown_parameter"),
    ("/update_weights_from_disk", {"model_path": "/c", "flush_cache": "yes"}, "flush_cache", "invalid_type"),
    ("/update_weights_from_tensor", {}, "named_tensors", "missing_required_parameter"),
    ("/init_weights_update_group", {**GROUP, "master_port": 70000}, "master_port", "invalid_value"),
    ("/init_weights_update_group", {**GROUP, "master_port": "x"}, "master_port", "invalid_type"),
    ("/init_weights_update_group", {**GROUP, "backend": "mpi"}, "backend", "invalid_value"),
    ("/update_weights_from_distributed", {**DIST, "shapes": []}, "shapes", "invalid_value"),
    ("/update_weights_from_distributed", {**DIST, "shapes": [[2], [3]]}, "names", "invalid_value"),
    ("/update_weights_from_distributed", {**DIST, "dtypes": ["int4"]}, "dtypes", "invalid_value"),
    ("/destroy_weights_update_group", {"group_name": ""}, "group_name", "invalid_value"),
    ("/get_weights_by_name", {"name": "w", "truncate_size": -1}, "truncate_size", "invalid_value"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "tags", "invalid_value"),
    ("/resume_memory_occupation", {"tags": "weights"}, "tags", "invalid_type"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body", "param", "code"), BAD_BODIES,
                         ids=[f"{p}-{f}-{i}" for i, (p, _, f, _) in enumerate(BAD_BODIES)])
async def test_bad_bodies_are_400s_naming_the_field(http: Http, path: str, body: dict[str, Any], param: str,
                                                    code: str) -> None:
    r = await http.post(path, body)
    assert r.status_code == 400, r.text
    out = r.json()
    assert (out["error"]["param"], out["error"]["code"], out["error"]["type"]) == (param, code,
                                                                                  "invalid_request_error")
    assert out["success"] is False and out["message"] == out["error"]["message"]
    assert http.sched.control == []


@pytest.mark.anyio
async def test_bad_abort_bodies_are_400s(http: Http) -> None:
    r = await http.post("/abort_request", {"rid": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    r = await http.post("/abort_request", {"rid": "x", "abort_all": False, "all": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


@pytest.mark.anyio
async def test_sglang_bodies_are_accepted_and_answered_in_sglangs_shape(http: Http) -> None:
    data: dict[type, dict[str, Any]] = {AbortAllReq: {"aborted": 3}, GetWeightsByNameReq: {"parameter": [0.25]},
                                        UpdateWeightsFromDiskReq: {"weight_version": "step-1"}}
    http.sched.answer = lambda m: ControlReqOutput(success=True, data=data.get(type(m), {}))
    sglang_disk = {"model_path": "/ckpt", "load_format": None, "abort_all_requests": False, "weight_version": "step-1",
                   "is_async": False, "torch_empty_cache": True, "keep_pause": False, "recapture_cuda_graph": True,
                   "token_step": 7, "flush_cache": False}
    r = await http.post("/update_weights_from_disk", sglang_disk)
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0,
                        "weight_version": "step-1"}

    paused = (await http.post("/pause_generation", {"mode": "retract"})).json()
    assert paused == {"success": True, "message": "Generation paused successfully.", "status": "ok"}
    assert (await http.post("/pause_generation")).status_code == 200  # a bare POST: mode abort
    assert (await http.post("/continue_generation", {"torch_empty_cache": False})).json()["status"] == "ok"
    assert (await http.post("/abort_request", {"rid": "", "abort_all": True})).json() == {"success": True,
                                                                                          "aborted": 3}
    assert (await http.post("/init_weights_update_group", {**GROUP, "group_name": "g", "backend": "gloo"})).json()[
        "success"]
    assert (await http.post("/update_weights_from_distributed", {**DIST, "group_name": "g", "flush_cache": True,
                                                                 "abort_all_requests": True,
                                                                 "weight_version": "d1"})).status_code == 200
    assert (await http.post("/destroy_weights_update_group", {"group_name": "g"})).status_code == 200
    assert (await http.post("/get_weights_by_name", {"name": "w", "truncate_size": 1})).json() == [0.25]
    assert (await http.client.get("/get_weights_by_name", params={"name": "w", "truncate_size": "1"})).json() == [
        0.25]
    assert (await http.client.get("/release_memory_occupation")).json()["success"]
    assert (await http.post("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})).status_code == 200
    assert (await http.client.get("/get_weight_version")).json() == {"weight_version": "v7"}

    assert http.sched.control == [
        UpdateWeightsFromDiskReq(model_path="/ckpt", weight_version="step-1", flush_cache=False, req_id=1),
        PauseGenerationReq(mode="retract", req_id=2), PauseGenerationReq(mode="abort", req_id=3),
        ContinueGenerationReq(req_id=4), AbortAllReq(req_id=5),
        InitWeightsUpdateGroupReq(group_name="g", backend="gloo", req_id=6, **GROUP),
        UpdateWeightsFromDistributedReq(group_name="g", abort_all_requests=True, weight_version="d1", req_id=7,
                                        **DIST),
        DestroyWeightsUpdateGroupReq(group_name="g", req_id=8),
        GetWeightsByNameReq(name="w", truncate_size=1, req_id=9), GetWeightsByNameReq(name="w", truncate_size=1,
                                                                                      req_id=10),
        ReleaseMemoryReq(req_id=11), ResumeMemoryReq(tags=["weights", "kv_cache"], req_id=12),
    ]


@pytest.mark.anyio
async def test_shared_tensors_travel_as_json_and_pickles_are_refused(http: Http) -> None:
    r = await http.post("/update_weights_from_tensor", {"named_tensors": msgspec.to_builtins(SPEC),
                                                        "weight_version": "t1"})
    assert r.status_code == 200, r.text
    assert http.sched.control == [UpdateWeightsFromTensorReq(tensors=SPEC, weight_version="t1", req_id=1)]

    r = await http.post("/update_weights_from_tensor", {"serialized_named_tensors": ["gASVAAAA"],
                                                        "load_format": None, "flush_cache": True})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "serialized_named_tensors" and "never unpickles" in err["message"]
    assert "Send named_tensors instead: a SharedTensors" in err["message"]
    assert len(http.sched.control) == 1


@pytest.mark.anyio
async def test_a_refused_call_is_a_400_in_both_shapes(http: Http) -> None:
    http.sched.answer = lambda m: ControlReqOutput(success=False, message="checkpoint has another architecture")
    r = await http.post("/update_weights_from_disk", {"model_path": "/other"})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "checkpoint has another architecture", "type": "invalid_request_error",
                                  "param": None, "code": None},
                        "success": False, "message": "checkpoint has another architecture"}


@pytest.mark.anyio
@pytest.mark.parametrize(("keys", "control_key"), [({"api_key": "user", "admin_api_key": "root"}, "root"),
                                                   ({"api_key": "user"}, "user"), ({"admin_api_key": "root"}, "root")])
async def test_control_routes_need_the_admin_key_when_there_is_one(keys: dict[str, str], control_key: str) -> None:
    h = Http(**keys)
    user = {"Authorization": "Bearer user"} if "api_key" in keys else {}
    admin = {"Authorization": f"Bearer {control_key}"}
    try:
        for path, body in [("/pause_generation", {}), ("/update_weights_from_disk", {"model_path": "/c"}),
                           ("/release_memory_occupation", {}), ("/flush_cache", {}),
                           ("/abort_request", {"abort_all": True})]:
            expect_user = 200 if control_key == "user" else 401
            assert (await h.post(path, body, headers=user)).status_code == expect_user, path
            assert (await h.post(path, body, headers=admin)).status_code == 200, path
        for headers in (user, admin):  # the admin key opens every route
            assert (await h.post("/abort_request", {"rid": "r1"}, headers=headers)).status_code == 200
            assert (await h.client.get("/get_weight_version", headers=headers)).status_code == 200
        wrong = {"Authorization": "Bearer nobody"}
        assert (await h.client.get("/get_weight_version", headers=wrong)).status_code == (401 if keys.get("api_key")
                                                                                          else 200)
        if "api_key" in keys:
            assert (await h.post("/pause_generation", {})).status_code == 401
    finally:
        await h.close()


@pytest.mark.anyio
async def test_control_calls_need_an_open_engine(http: Http) -> None:
    await http.engine.aclose()
    with pytest.raises(RuntimeError, match="shut down"):
        await http.engine.pause_generation()
    assert (await http.post("/continue_generation", {})).status_code == 503
