"""sgl.testing's FakeEngine held to the engine's contract: the public surface of
AsyncEngine and Engine, the real engine's result shapes chunk for chunk (a Hypothesis
property against the default model), the engine's rules and errors, every planted
fault seen through the public API, virtual time, and no torch in the caller's process."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import subprocess
import sys
import time
import typing
from collections.abc import AsyncIterator, Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sgl
from sgl.core.protocol import (
    CONTROL_PLANE,
    PAUSED_ABORT,
    UPDATE_ABORT,
    AbortReq,
    AttachReq,
    DetachReq,
    FlushCacheReq,
    GenerateReqInput,
    GetServerInfoReq,
    HealthCheckReq,
    Message,
    SetFaultsReq,
    SharedTensors,
    ShutdownReq,
    TensorEntry,
)
from sgl.engine.async_engine import AsyncEngine
from sgl.runtime.tokenizer_client import chat_ids
from sgl.sched.models.default_model import default_model_dir
from sgl.testing.fake import FakeEngine, FakeSyncEngine, run_virtual
from sgl.testing.faults import Abort, Busy, Control, Die, Fail, FaultPlan, Hang, Nth, Rid, SlowFirstToken, Where
from tests.conftest import assert_kv_balanced
from tests.hypothesis_profiles import PROFILE

EOS = 257  # the built-in byte-level tokenizer's <|im_end|>

# ---- the surface -----------------------------------------------------------------------

ENTRY = ("__aenter__", "__aexit__", "__enter__", "__exit__")
CONSTRUCTORS = {"start"}  # each takes its own arguments: a model's, or a responder's
NO_FAKE = {"connect": "attaches to a running server's scheduler over tcp; a fake has no server"}


def surface(cls: type) -> dict[str, str]:
    """Each public method's kind and signature, each property by name."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") and name not in ENTRY:
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (property, functools.cached_property)):
            out[name] = "property"
        elif isinstance(attr, classmethod):
            fn = attr.__func__
            out[name] = "async classmethod" if inspect.iscoroutinefunction(fn) else "classmethod"
            if name not in CONSTRUCTORS:
                out[name] += str(inspect.signature(fn))
        elif callable(attr):
            kind = "async " if inspect.iscoroutinefunction(attr) else "gen " if inspect.isasyncgenfunction(attr) else ""
            out[name] = kind + str(inspect.signature(attr))
    return out


def test_fake_engine_has_async_engines_surface() -> None:
    real = {k: v for k, v in surface(AsyncEngine).items() if k not in NO_FAKE}
    assert surface(FakeEngine) == real


def test_fake_sync_engine_has_engines_surface() -> None:
    assert surface(FakeSyncEngine) == surface(sgl.Engine)


def test_the_scripted_scheduler_answers_every_request_the_front_end_sends() -> None:
    requests = {t for t in typing.get_args(Message) if t.__name__.endswith(("Req", "ReqInput"))}
    # Attaching, detaching and shutting down are not the fake's: it has no route and no roles. A new
    # request message must be answered in sgl/testing/scripted.py (ScriptedScheduler.handle) first.
    assert requests == {GenerateReqInput, AbortReq, FlushCacheReq, GetServerInfoReq, HealthCheckReq, SetFaultsReq,
                        AttachReq, DetachReq, ShutdownReq, *CONTROL_PLANE}


NO_TORCH = """
import asyncio, json, sys
from sgl.testing.fake import FakeEngine

async def main():
    async with FakeEngine(["one two", '{"a": 1}']) as e:
        await e.generate("hi", {"max_new_tokens": 8, "stop": " "})
        [c async for c in e.stream("hi", {"max_new_tokens": 8, "n": 2}, return_logprob=True, top_logprobs_num=2)]
        await e.generate("hi", {"max_new_tokens": 8, "json_schema": '{"type": "object"}'})
        await e.get_server_info()

asyncio.run(main())
print(json.dumps([m for m in ("torch", "transformers", "xgrammar") if m in sys.modules]))
"""


def test_a_fake_engine_imports_no_torch() -> None:
    run = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


# ---- the same shapes as the real engine ------------------------------------------------

PROMPTS = ["The capital of France is", "Count to five:", "def add(a, b):", "Q: What is 2+2?\nA:",
           "List three colors:", "Translate 'cat' to French:", "Once upon a time"]


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    e = sgl.Engine(transport="inproc", dtype="float32", max_total_tokens=4096)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def twin(engine: sgl.Engine) -> Iterator[tuple[FakeSyncEngine, dict[str, str]]]:
    """A fake on the default model's tokenizer whose responder gives, per prompt, the text
    the real engine just generated for it."""
    answers: dict[str, str] = {}
    fake = FakeSyncEngine(answers, model_path=default_model_dir(), max_total_tokens=4096)
    yield fake, answers
    fake.shutdown()


@st.composite
def greedy_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any], dict[str, Any], bool]:
    m = draw(st.integers(0, 4))  # the CPU runs the default model at ~10-100 tokens/s
    params: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": m, "n": draw(st.sampled_from([1, 1, 1, 2])),
                              "min_new_tokens": draw(st.integers(0, min(m, 3))), "no_stop_trim": draw(st.booleans())}
    if draw(st.booleans()):
        params["stop"] = draw(st.lists(st.sampled_from([" the", ".", "\n", ",", " a", "e"]), min_size=1, max_size=2))
    if draw(st.booleans()):
        params["stop_token_ids"] = [draw(st.sampled_from([2, 28, 30, 198]))]  # EOS "," "." "\n"
    opts: dict[str, Any] = {"detokenize": draw(st.sampled_from([True, True, False]))}
    if draw(st.booleans()):
        opts.update(return_logprob=True, logprob_start_len=draw(st.sampled_from([-1, 0, 1])),
                    top_logprobs_num=draw(st.sampled_from([0, 2])), return_text_in_logprobs=draw(st.booleans()),
                    token_ids_logprob=draw(st.sampled_from([None, [5, 198]])))
    return draw(st.sampled_from(PROMPTS)), params, opts, draw(st.booleans())


def shape(result: Any) -> Any:
    """What must agree between the two engines: all but the logprob values, the top
    logprobs' ids (a model's) and the timing."""
    if isinstance(result, list):
        return [shape(r) for r in result]
    meta = {k: type(v).__name__ if k == "e2e_latency" else _logprobs_shape(v, exact="top" not in k)
            if k.endswith("logprobs") else v for k, v in result["meta_info"].items()}
    return {"text": result["text"], "output_ids": result["output_ids"], "index": result.get("index"), "meta": meta}


def _logprobs_shape(v: Any, exact: bool) -> Any:
    if v is None:
        return None
    if isinstance(v, tuple):  # (logprob, token_id, text)
        return (type(v[0]).__name__, *(v[1:] if exact else (type(v[1]).__name__, type(v[2]).__name__)))
    return [_logprobs_shape(x, exact) for x in v]


def by_stream(chunks: list[dict[str, Any]]) -> dict[int, list[Any]]:
    """A stream's chunks per sample, in order (samples interleave as they are scheduled)."""
    out: dict[int, list[Any]] = {}
    for c in chunks:
        out.setdefault(c.get("index", 0), []).append(shape(c))
    return out


def untrimmed_text(engine: sgl.Engine, result: Any, stream: bool) -> str:
    """The real engine's output (its first sample's) before stop trimming, without a
    closing EOS (the fake adds its own)."""
    if stream:
        chunks = [c for c in result if c.get("index", 0) == 0]
        ids, fin = [t for c in chunks for t in c["output_ids"]], chunks[-1]["meta_info"]["finish_reason"]
    else:
        first = result[0] if isinstance(result, list) else result
        ids, fin = first["output_ids"], first["meta_info"]["finish_reason"]
    if fin["type"] == "stop" and fin["matched"] == 2:
        ids = ids[:-1]
    return str(engine.tokenizer.decode(ids, skip_special_tokens=False))


RIDS = iter(range(10**9))


@settings(PROFILE, max_examples=12)
@given(req=greedy_requests())
def test_the_fake_gives_the_real_engines_shapes_chunk_for_chunk(
        engine: sgl.Engine, twin: tuple[FakeSyncEngine, dict[str, str]],
        req: tuple[str, dict[str, Any], dict[str, Any], bool]) -> None:
    prompt, params, opts, stream = req
    fake, answers = twin
    rid = f"r{next(RIDS)}"
    real = engine.generate(prompt, params, stream=stream, rid=rid, **opts)
    real = list(real) if stream else real
    answers[prompt] = untrimmed_text(engine, real, stream)
    got = fake.generate(prompt, params, stream=stream, rid=rid, **opts)
    if stream:
        assert by_stream(list(got)) == by_stream(real)
    else:
        assert shape(got) == shape(real)


# ---- the engine's rules ------------------------------------------------------------------


def collect(gen: AsyncIterator[dict[str, Any]]) -> Any:
    async def all_of() -> list[dict[str, Any]]:
        return [c async for c in gen]
    return all_of()


def test_stop_strings_are_held_back_in_streams_and_trimmed() -> None:
    async def main() -> None:
        async with FakeEngine("Hello world. Bye") as e:
            chunks = await collect(e.stream("x", {"max_new_tokens": 30, "stop": "world"}))
            assert all("w" not in c["text"] for c in chunks)  # never the start of the stop string
            assert "".join(c["text"] for c in chunks) == "Hello "
            assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "world"}
            out = await e.generate("x", {"max_new_tokens": 30, "stop": "world", "no_stop_trim": True})
            assert out["text"] == "Hello world"
            assert_kv_balanced(await e.get_server_info())
    asyncio.run(main())


def test_lengths_stop_ids_eos_and_min_new_tokens() -> None:
    with FakeSyncEngine("ab") as e:
        out = e.generate("x", {"max_new_tokens": 10})
        assert out["output_ids"] == [97, 98, EOS] and out["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                           "matched": EOS}
        out = e.generate("x", {"max_new_tokens": 10, "min_new_tokens": 5})
        assert len(out["output_ids"]) > 5 and EOS not in out["output_ids"][:-1]
        out = e.generate("x", {"max_new_tokens": 7, "ignore_eos": True})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7} and EOS in out["output_ids"]
        out = e.generate("x", {"max_new_tokens": 10, "stop_token_ids": [98]})
        assert (out["text"], out["output_ids"]) == ("a", [97, 98])
        out = e.generate("x", {"max_new_tokens": 1})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
        out = e.generate("x", {"max_new_tokens": 4}, detokenize=False)
        assert out["text"] == "" and out["output_ids"] == [97, 98, EOS]
        assert_kv_balanced(e.get_server_info())


def test_n_samples_ask_the_responder_each_with_its_seed() -> None:
    seen: list[int | None] = []

    def responder(prompt: str, params: sgl.SamplingParams) -> str:
        seen.append(params.seed)
        return f"{prompt} {params.seed}"

    with FakeSyncEngine(responder) as e:
        outs = e.generate("seed", {"max_new_tokens": 20, "n": 3, "seed": 7})
        assert [o["text"] for o in outs] == ["seed 7", "seed 8", "seed 9"] and seen == [7, 8, 9]
        chunks = list(e.generate("s", {"max_new_tokens": 20, "n": 2, "seed": 1}, stream=True))
        assert {c["index"] for c in chunks} == {0, 1}


def test_beams_come_as_a_list_best_first() -> None:
    with FakeSyncEngine(["aaaa", "bb", "c"]) as e:
        beams = e.generate("x", {"max_new_tokens": 8, "beam_width": 3, "num_return_beams": 2})
        assert [b["meta_info"]["beam_index"] for b in beams] == [0, 1]
        scores = [b["meta_info"]["score"] for b in beams]
        assert scores == sorted(scores, reverse=True)
        with pytest.raises(ValueError, match="beam_width"):
            next(iter(e.generate("x", {"beam_width": 2}, stream=True)))


@pytest.mark.parametrize(("params", "options", "field"), [
    ({"temperature": -1.0}, {}, "temperature"),
    ({"n": 0}, {}, "n"),
    ({"max_new_tokens": 5000}, {}, "max_new_tokens"),  # past the built-in context of 4096
    ({"stop_token_ids": [300]}, {}, "stop_token_ids"),  # past the built-in vocabulary of 258
    ({}, {"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({}, {"logprob_start_len": 5, "return_logprob": True}, "logprob_start_len"),
    ({"json_schema": "{not json"}, {}, "json_schema"),
    ({"regex": r"[^\s\S]"}, {}, "regex: the grammar matches no text"),  # as the scheduler's compile refuses it
    ({"constraint": {"name": "never-kept"}}, {}, "constraint.name: no trie is kept"),
])
def test_invalid_requests_raise_the_engines_value_errors(params: dict[str, Any], options: dict[str, Any],
                                                         field: str) -> None:
    with FakeSyncEngine() as e:
        with pytest.raises(ValueError, match=field):
            e.generate("x", params, **options)


def test_the_responders_own_failures_name_it() -> None:
    with FakeSyncEngine({"known": "yes"}) as e:
        assert e.generate("known")["text"] == "yes"
        with pytest.raises(ValueError, match="responder: KeyError"):
            e.generate("unknown")


def test_ids_in_ids_out_without_a_tokenizer() -> None:
    with FakeSyncEngine("abc", skip_tokenizer_init=True) as e:
        out = e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 8})
        assert (out["text"], out["output_ids"]) == ("", [97, 98, 99, EOS])
        with pytest.raises(ValueError, match="prompt"):
            e.generate("text", {"max_new_tokens": 8})


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 5}},
          "required": ["name", "age"]}


def test_grammar_requests_return_matching_text() -> None:
    with FakeSyncEngine(["no json here", '{"name": "Ann", "age": 7}']) as e:
        written = e.generate("x", {"max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)})
        jsonschema.validate(json.loads(written["text"]), SCHEMA)
        assert written["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
        kept = e.generate("x", {"max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)})
        assert kept["text"] == '{"name": "Ann", "age": 7}'  # the responder's own, as it matches
        out = e.generate("x", {"max_new_tokens": 64, "regex": r"\d{3}-[a-z]+@x\.com"})
        assert re.fullmatch(r"\d{3}-[a-z]+@x\.com", out["text"])


def test_a_chat_renders_through_the_tokenizers_template() -> None:
    async def main() -> None:
        async with FakeEngine() as e:
            ids = await chat_ids(e.tm.tok, [{"role": "user", "content": "hi"}])  # as the OpenAI routes ask
            assert e.tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    asyncio.run(main())


# ---- faults ------------------------------------------------------------------------------


def test_a_dead_engine_fails_every_pending_and_later_call() -> None:
    async def main() -> None:
        async with FakeEngine("abcdefgh", per_token_s=1.0) as e:
            pending = e.stream("x", {"max_new_tokens": 8})
            await pending.__anext__()
            e.faults.add(Die(), Rid("killer"))
            with pytest.raises(sgl.EngineDeadError):
                await e.generate("y", rid="killer")
            with pytest.raises(sgl.EngineDeadError):
                await collect(pending)
            with pytest.raises(sgl.EngineDeadError):
                await e.generate("z")
            with pytest.raises(sgl.EngineDeadError):
                await e.health()
            assert e.dead_reason() is not None and "planted" in e.dead_reason()  # type: ignore[operator]

    async def at_a_control_call() -> None:
        async with FakeEngine(faults=FaultPlan()) as e:
            e.faults.add(Die(), Control("server_info"))
            with pytest.raises(sgl.EngineDeadError):
                await e.get_server_info()
            with pytest.raises(sgl.EngineDeadError):
                await e.generate("x")
    run_virtual(main())
    run_virtual(at_a_control_call())


def test_busy_refusals_by_plan_and_by_a_full_queue() -> None:
    async def main() -> None:
        plan = FaultPlan()
        plan.add(Busy(), Nth(2))
        async with FakeEngine("ok", faults=plan, max_running_requests=1, max_queued_requests=1, per_token_s=1.0) as e:
            assert (await e.generate("1"))["text"] == "ok"
            with pytest.raises(sgl.ServerBusyError):
                await e.generate("2")
            running = e.stream("3", {"max_new_tokens": 8})
            await running.__anext__()
            waiting = asyncio.ensure_future(e.generate("4"))
            await asyncio.sleep(0)  # it sends its request before awaiting its answer
            assert (await e.get_server_info())["waiting"] == 1
            with pytest.raises(sgl.ServerBusyError, match="max_queued_requests=1"):
                await e.generate("5")
            await collect(running)
            assert (await waiting)["text"] == "ok"
            assert_kv_balanced(await e.get_server_info())
    run_virtual(main())


def test_a_hung_request_meets_the_callers_timeout_and_is_aborted() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with FakeEngine("abcdef", faults=FaultPlan(), health_timeout=10.0) as e:
            e.faults.add(Hang(after_tokens=2), Rid("slow"))
            e.faults.add(Hang(), Control("health"))
            got: list[dict[str, Any]] = []

            async def read() -> None:
                async for c in e.stream("x", {"max_new_tokens": 8}, rid="slow"):
                    got.append(c)

            t0 = loop.time()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(read(), 30.0)
            assert len(got) == 2 and loop.time() - t0 == pytest.approx(30.0)
            assert e.open_requests == 0
            with pytest.raises(TimeoutError, match="HealthCheck"):
                await e.health()
            assert_kv_balanced(await e.get_server_info())  # the abort reached the scheduler first
    started = time.monotonic()
    run_virtual(main())
    assert time.monotonic() - started < 5.0  # 40 s of loop time


@pytest.mark.parametrize(("effect", "message"), [
    (Abort(after_tokens=3), "aborted by the client"),
    (Fail(after_tokens=3), "internal error in forward (RuntimeError): a planted fault"),
])
def test_a_stream_ends_mid_way_with_an_abort_reason(effect: Abort | Fail, message: str) -> None:
    with FakeSyncEngine("abcdefgh", faults=FaultPlan()) as e:
        e.faults.add(effect, Where(lambda r: r.prompt == "boom"))
        chunks = list(e.generate("boom", {"max_new_tokens": 8}, stream=True))
        assert "".join(c["text"] for c in chunks) == "abc"  # chunks a slow reader missed come joined
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": message}
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        assert e.generate("calm", {"max_new_tokens": 3})["text"] == "abc"  # the engine serves on
        assert e.get_server_info()["failures"] == int(isinstance(effect, Fail))
        assert_kv_balanced(e.get_server_info())


def test_a_slow_first_token_on_virtual_time() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        async with FakeEngine("abcd", per_token_s=0.5) as e:
            e.faults.next_request(SlowFirstToken(30.0))
            t0 = loop.time()
            return [loop.time() - t0 async for _ in e.stream("x", {"max_new_tokens": 8})]
    started = time.monotonic()
    arrivals = run_virtual(main())
    assert arrivals == pytest.approx([30.0, 30.5, 31.0, 31.5, 32.0])
    assert time.monotonic() - started < 5.0


def test_selectors_pick_their_requests() -> None:
    plan = FaultPlan()
    every_second = plan.add(Busy(), Nth(2, every=True))
    once = plan.next_request(Abort())
    with FakeSyncEngine("ok", faults=plan) as e:
        outcomes = []
        for i in range(6):
            try:
                outcomes.append(e.generate(str(i))["meta_info"]["finish_reason"]["type"])
            except sgl.ServerBusyError:
                outcomes.append("busy")
        assert outcomes == ["abort", "busy", "stop", "busy", "stop", "busy"]
        assert (every_second.fired, once.fired) == (3, 1)
        assert [type(effect).__name__ for effect, _ in plan.fired][:2] == ["Abort", "Busy"]


def test_the_sync_twin_on_virtual_time() -> None:
    started = time.monotonic()
    with FakeSyncEngine("x" * 40, virtual_time=True, first_token_s=10.0, per_token_s=1.0) as e:
        assert len(list(e.generate("x", {"max_new_tokens": 64}, stream=True))) == 41  # 40 "x", then EOS
    assert time.monotonic() - started < 5.0  # 50 s of loop time


# ---- the control plane (tests/test_control_plane.py's checks, on the fake) ----------------

LOAD = 12
LONG = {"max_new_tokens": 60, "ignore_eos": True}


def echo(prompt: str, params: sgl.SamplingParams) -> str:
    """Each prompt's own output: the prompt three times (then EOS, and again)."""
    return prompt * 3


async def until(e: FakeEngine, key: str, n: int) -> dict[str, Any]:
    """Server info once info[key] == n (each call is a turn of the scheduler's loop)."""
    while (info := await e.get_server_info())[key] != n:
        await asyncio.sleep(0.005)
    return info


async def read(e: FakeEngine, prompt: str, params: dict[str, Any], got: list[int], versions: list[str],
               started: asyncio.Event) -> dict[str, Any]:
    last: dict[str, Any] = {}
    async for chunk in e.stream(prompt, params):
        got.extend(chunk["output_ids"])
        versions.append(chunk["meta_info"]["weight_version"])
        started.set()
        last = chunk
    return dict(last["meta_info"])


def test_the_fake_answers_every_control_plane_call() -> None:
    async def main() -> None:
        async with FakeEngine() as e:
            assert (await e.pause_generation(mode="in_place")) == {"num_paused_requests": 0, "success": True,
                                                                   "message": "generation paused (in_place)"}
            assert (await e.continue_generation())["success"]
            assert await e.abort_all() == 0
            await e.abort(abort_all=True)
            assert (await e.update_weights_from_disk("policy-1"))["weight_version"] == "1"
            shared = SharedTensors(entries=[TensorEntry("w", "float32", [2], 0)], nbytes=8, shm_name="unread")
            assert (await e.update_weights_from_tensor(shared, weight_version="t"))["weight_version"] == "t"
            assert (await e.init_weights_update_group("127.0.0.1", 29500, 1, 2))["success"]
            out = await e.update_weights_from_distributed(["w"], ["float32"], [[2]])
            assert out == {"weight_version": "3", "num_paused_requests": 0, "success": True, "message": out["message"]}
            assert (await e.destroy_weights_update_group())["success"]
            with pytest.raises(ValueError, match="no weights"):
                await e.get_weights_by_name("model.embed_tokens.weight")
            assert (await e.release_memory_occupation())["success"]
            assert (await e.resume_memory_occupation())["success"]
            assert await e.get_weight_version() == "3"
            info = await e.get_server_info()
            assert (info["paused"], info["memory_released"], info["weight_version"]) == (None, [], "3")
    run_virtual(main())


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_under_streaming_load(mode: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with FakeEngine(echo, per_token_s=1.0, max_running_requests=16) as e:
            prompts = [f"p{i}" for i in range(LOAD)]
            want = [o["output_ids"] for o in await e.generate(prompts, LONG)]  # the unpaused run
            got: list[list[int]] = [[] for _ in prompts]
            started = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(read(e, p, LONG, g, [], s)) for p, g, s in zip(prompts, got, started)]
            await asyncio.gather(*(s.wait() for s in started))
            await asyncio.sleep(5.5)  # some tokens in
            paused = await e.pause_generation(mode=mode)
            assert paused["num_paused_requests"] == (0 if mode == "abort" else LOAD)
            seen = [len(g) for g in got]  # outputs sent before the answer arrived before it
            late = asyncio.create_task(e.generate("late", {**LONG, "max_new_tokens": 3}))
            info = await until(e, "waiting", {"in_place": 1, "retract": LOAD + 1, "abort": 1}[mode])
            await asyncio.sleep(600.0)  # a long pause: nothing moves
            assert [len(g) for g in got] == seen, "tokens arrived while paused"
            assert info["running"] == (LOAD if mode == "in_place" else 0) and not late.done()
            assert info["paused"] == mode
            t0 = loop.time()
            await e.continue_generation()
            metas = await asyncio.gather(*tasks)
            assert (await late)["text"] == "lat"
            for g, w, m in zip(got, want, metas):
                if mode == "abort":
                    assert m["finish_reason"] == {"type": "abort", "message": PAUSED_ABORT} and g == w[: len(g)]
                else:
                    assert m["finish_reason"]["type"] == "length" and g == w
            if mode != "abort":  # the rest of the outputs, one a second from the continue on
                assert len(set(seen)) == 1 and loop.time() - t0 == LONG["max_new_tokens"] - seen[0] - 1
            assert_kv_balanced(await e.get_server_info())
    run_virtual(main())


def test_a_trainer_step_pause_update_continue() -> None:
    async def main() -> None:
        async with FakeEngine(echo, per_token_s=1.0) as e:
            prompts = ["rollout a", "rollout b"]
            want = [o["output_ids"] for o in await e.generate(prompts, LONG)]
            got: list[list[int]] = [[] for _ in prompts]
            versions: list[list[str]] = [[] for _ in prompts]
            started = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(read(e, p, LONG, g, v, s))
                     for p, g, v, s in zip(prompts, got, versions, started)]
            await asyncio.sleep(10.5)
            await e.pause_generation(mode="retract")
            out = await e.update_weights_from_disk("policy-1", weight_version="step-1")
            assert out["weight_version"] == "step-1" and out["num_paused_requests"] == 2
            await e.continue_generation()
            metas = await asyncio.gather(*tasks)
            assert got == want  # the rollouts finished as they would have, on the new weights
            assert all(m["weight_version"] == "step-1" for m in metas)
            assert all(v[0] == "default" and v[-1] == "step-1" and sorted(set(v)) == ["default", "step-1"]
                       for v in versions)
            await e.update_weights_from_disk("policy-2")
            assert (await e.generate("rollout a", LONG))["meta_info"]["cached_tokens"] == 0  # flushed
            await e.update_weights_from_disk("policy-3", flush_cache=False)
            assert await e.get_weight_version() == "3"  # the count of updates
            assert (await e.generate("rollout a", LONG))["meta_info"]["cached_tokens"] > 0
            assert_kv_balanced(await e.get_server_info())
    run_virtual(main())


def test_a_weight_update_waits_for_the_running_requests() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with FakeEngine(echo, per_token_s=1.0) as e:
            versions: list[str] = []
            started = asyncio.Event()
            stream = asyncio.create_task(read(e, "running", {"max_new_tokens": 20, "ignore_eos": True}, [], versions,
                                              started))
            await asyncio.sleep(5.5)
            update = asyncio.create_task(e.update_weights_from_disk("policy-1", weight_version="step-1"))
            late = asyncio.create_task(e.generate("late", {"max_new_tokens": 3}))
            info = await until(e, "waiting", 1)  # admission stops while the update waits
            assert (info["running"], info["weight_updates_waiting"], info["weight_version"]) == (1, 1, "default")
            out = await update
            finished = loop.time()
            assert stream.done() and finished == pytest.approx(19.0)  # once the stream's last token was out
            assert set(versions) == {"default"} and out["num_paused_requests"] == 1
            late_out = await late
            assert late_out["meta_info"]["weight_version"] == "step-1" and late_out["text"] == "lat"
            # With abort_all_requests the update runs at once: the running requests end.
            stream = asyncio.create_task(read(e, "running", LONG, [], [], asyncio.Event()))
            await asyncio.sleep(2.5)
            t0 = loop.time()
            out = await e.update_weights_from_disk("policy-2", abort_all_requests=True)
            assert loop.time() == t0 and out["weight_version"] == "2"
            assert (await stream)["finish_reason"] == {"type": "abort", "message": UPDATE_ABORT}
            assert_kv_balanced(await e.get_server_info())
    run_virtual(main())


def test_refusals_abort_all_and_released_memory() -> None:
    async def main() -> None:
        async with FakeEngine("abc", per_token_s=1.0) as e:
            await e.pause_generation(mode="in_place", refuse_new=True)
            with pytest.raises(sgl.ServerBusyError, match="paused"):
                await e.generate("x", LONG)
            await e.continue_generation()
            await e.continue_generation()  # continuing a running engine is no error
            # abort_all ends every request, queued ones too.
            await e.pause_generation(mode="in_place")
            tasks = [asyncio.create_task(e.generate(str(i), LONG)) for i in range(5)]
            await until(e, "waiting", 5)
            assert (await e.abort_all()) == 5
            assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in await asyncio.gather(*tasks))
            await e.continue_generation()
            # The KV cache is released only with no request holding KV.
            running = asyncio.create_task(e.generate("y", LONG))
            await until(e, "running", 1)
            with pytest.raises(ValueError, match="1 requests hold KV"):
                await e.release_memory_occupation(["kv_cache"])
            await e.pause_generation(mode="in_place")
            with pytest.raises(ValueError, match="hold KV"):
                await e.release_memory_occupation()
            await e.pause_generation(mode="retract")
            await e.release_memory_occupation(["kv_cache"])
            await e.continue_generation()  # still released: nothing is scheduled
            late = asyncio.create_task(e.generate("z", {"max_new_tokens": 3}))
            info = await until(e, "waiting", 2)
            await asyncio.sleep(100.0)
            assert info["memory_released"] == ["kv_cache"] and not late.done() and not running.done()
            with pytest.raises(ValueError, match="'kv_cache' is released already"):
                await e.release_memory_occupation(["kv_cache"])
            with pytest.raises(ValueError, match="'weights' is not released"):
                await e.resume_memory_occupation(["weights"])
            await e.resume_memory_occupation(["kv_cache"])
            assert (await late)["text"] == "abc" and (await running)["meta_info"]["finish_reason"]["type"] == "length"
            # Released weights refuse an update and stop scheduling; the version stays.
            await e.release_memory_occupation(["weights"])
            with pytest.raises(ValueError, match="the weights are released"):
                await e.update_weights_from_disk("policy-1")
            with pytest.raises(ValueError, match="'kv_cache' is not released"):
                await e.resume_memory_occupation()  # None is both: each must be released
            await e.resume_memory_occupation(["weights"])
            # Groups are joined once and left once; an update needs its group.
            with pytest.raises(ValueError, match="no such weight update group"):
                await e.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g")
            await e.init_weights_update_group("127.0.0.1", 29500, 1, 2, group_name="g")
            with pytest.raises(ValueError, match="in that group already"):
                await e.init_weights_update_group("127.0.0.1", 29500, 1, 2, group_name="g")
            await e.destroy_weights_update_group("g")
            with pytest.raises(ValueError, match="no such weight update group"):
                await e.destroy_weights_update_group("g")
            info = await e.get_server_info()
            assert info["weight_version"] == "default" and info["memory_released"] == []
            assert_kv_balanced(info)
    run_virtual(main())
