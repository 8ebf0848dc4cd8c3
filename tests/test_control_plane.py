"""The control plane end to end, through a real engine (scheduler in its own process):

- weights: a trainer in another process changes them (a second checkpoint on disk,
  noise on some tensors through shared memory, tensors broadcast over a gloo group)
  and after each update the greedy outputs equal Hugging Face's on the new weights in
  float32, token for token; the radix cache never serves KV made by the old weights;
  a refused update (another architecture, a wrong shape) leaves the old weights;
- pause in each mode under a load of streams: nothing lost, nothing hangs, no token
  while paused, "retract" and "in_place" end every request exactly as it would have
  ended, "abort" ends them with an abort; new requests wait, or are refused;
- abort_all, and memory release and resume (requests wait while released).
After each test the KV accounting balances."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load_file

import sgl
from sgl.core.protocol import SharedTensors
from sgl.runtime.tokenizer_manager import ServerBusyError
from tests.conftest import assert_kv_balanced, null_continuation, other_rank_failed, tiny_model_dir

VOCAB = 96
PROMPTS = [[5, 17, 33, 3, 42, 8, 77, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [11, 2], [64, 65, 66, 67, 1, 0, 12]]
NEW = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
NOISY = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], overrides: dict[str, torch.Tensor] | None = None
              ) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if overrides:
        hf.load_state_dict(overrides, strict=False)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                              min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def noisy(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """The NOISY tensors of a checkpoint with noise added, the same in every process."""
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    return {n: weights[n] + 0.2 * torch.randn(weights[n].shape, generator=g) for n in NOISY}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the trainer's side, in its own process ----

def share_trainer(model_dir: str, seed: int, conn: Any) -> None:
    """Pack noisy tensors into shared memory, send their description, keep them until told."""
    from sgl.weights import share_tensors

    with share_tensors(noisy(model_dir, seed)) as buf:
        conn.send_bytes(msgspec.json.encode(buf.spec))
        conn.recv()  # the engine has read them


def broadcast_trainer(model_dir: str, seed: int, port: int, conn: Any) -> None:
    """Rank 0 of a 2-rank gloo group: broadcast noisy tensors, in NOISY's order, when told."""
    from sgl.weights import init_update_group

    group = init_update_group("127.0.0.1", port, rank=0, world_size=2, group_name="trainer", backend="gloo")
    conn.send("joined")
    conn.recv()
    for tensor in noisy(model_dir, seed).values():
        group.broadcast(tensor, src=0)
    conn.recv()
    group.close()


def spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, there), daemon=True)
    proc.start()
    return proc, here


# ---- weights ----

@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("refit")
    return {"a": tiny_model_dir(base, "llama", vocab=VOCAB, seed=1),
            "b": tiny_model_dir(base, "llama", vocab=VOCAB, seed=2),
            "qwen": tiny_model_dir(base, "qwen2", vocab=VOCAB, seed=3)}


@pytest.fixture(scope="module")
def engine(models: dict[str, str]) -> Iterator[sgl.Engine]:
    e = sgl.Engine(models["a"], transport="ipc", skip_tokenizer_init=True, dtype="float32",
                   max_total_tokens=1024, max_running_requests=8)
    yield e
    e.shutdown()


def outputs(engine: sgl.Engine, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], list[dict[str, Any]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    return [o["output_ids"] for o in outs], [o["meta_info"] for o in outs]


@pytest.fixture
def restored(engine: sgl.Engine, models: dict[str, str]) -> Iterator[None]:
    """Each test starts from checkpoint a's weights and leaves them so."""
    engine.update_weights_from_disk(models["a"])
    yield
    engine.update_weights_from_disk(models["a"])


def test_update_from_disk_equals_hf_and_drops_old_kv(engine: sgl.Engine, models: dict[str, str],
                                                      restored: None) -> None:
    before, meta = outputs(engine)
    assert before == hf_greedy(models["a"], PROMPTS)
    cached = outputs(engine)[1]
    assert cached[0]["cached_tokens"] > 0  # the long prompt is in the radix cache
    version = meta[0]["weight_version"]
    out = engine.update_weights_from_disk(models["b"], weight_version="step-1")
    assert out["success"] and out["weight_version"] == "step-1"
    after, meta = outputs(engine)
    assert after == hf_greedy(models["b"], PROMPTS) != before
    assert all(m["cached_tokens"] == 0 for m in meta), "KV of the old weights was served"
    assert {m["weight_version"] for m in meta} == {"step-1"} != {version}
    assert engine.get_server_info()["weight_version"] == "step-1"


def test_update_without_flush_keeps_the_cache(engine: sgl.Engine, models: dict[str, str], restored: None) -> None:
    outputs(engine)
    engine.update_weights_from_disk(models["a"], flush_cache=False)
    assert outputs(engine)[1][0]["cached_tokens"] > 0


def test_refused_updates_keep_the_old_weights(engine: sgl.Engine, models: dict[str, str], tmp_path: Path,
                                              restored: None) -> None:
    want = hf_greedy(models["a"], PROMPTS)
    version = engine.get_server_info()["weight_version"]
    with pytest.raises(ValueError, match="architecture|Qwen2|qwen2"):
        engine.update_weights_from_disk(models["qwen"])
    with pytest.raises(ValueError, match="exist"):
        engine.update_weights_from_disk(str(tmp_path / "nowhere"))
    from sgl.weights import share_tensors

    with share_tensors({NOISY[0]: torch.zeros(3, 3)}) as buf, pytest.raises(ValueError, match="shape"):
        engine.update_weights_from_tensor(buf.spec)
    with share_tensors({"model.layers.0.no_such.weight": torch.zeros(3)}) as buf, \
            pytest.raises(ValueError, match="no_such"):
        engine.update_weights_from_tensor(buf.spec)
    assert outputs(engine)[0] == want
    assert engine.get_server_info()["weight_version"] == version


def test_a_refused_update_aborts_nothing(engine: sgl.Engine, models: dict[str, str], tmp_path: Path,
                                        restored: None) -> None:
    """abort_all_requests aborts the live requests only for an update the engine takes: one
    refused by the checkpoint's config or headers (another architecture, no such path)
    leaves them running (a refused control call leaves the engine as it was)."""
    async def main() -> dict:
        e = engine._engine
        await e.pause_generation("in_place")  # it waits in the queue meanwhile: nothing ends it but an abort
        try:
            task = asyncio.ensure_future(e.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY,
                                                                                            "max_new_tokens": 8}))
            for _ in range(500):  # until the scheduler holds it
                if (await e.get_server_info())["waiting"]:
                    break
                await asyncio.sleep(0.01)
            for path in (models["qwen"], str(tmp_path / "nowhere")):
                with pytest.raises(ValueError):
                    await e.update_weights_from_disk(path, abort_all_requests=True)
        finally:
            await e.continue_generation()
        return await task

    out = engine._run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
    assert out["output_ids"] == hf_greedy(models["a"], PROMPTS[:1])[0][:8]


def test_update_from_tensors_of_another_process(engine: sgl.Engine, models: dict[str, str], restored: None) -> None:
    proc, conn = spawn(share_trainer, models["a"], 7)
    try:
        spec = msgspec.json.decode(conn.recv_bytes(), type=SharedTensors)
        out = engine.update_weights_from_tensor(spec, weight_version="noisy")
        conn.send("done")
    finally:
        proc.join(30)
    assert out["success"] and proc.exitcode == 0
    assert outputs(engine)[0] == hf_greedy(models["a"], PROMPTS, noisy(models["a"], 7))
    got = engine.get_weights_by_name(NOISY[0], truncate_size=10)
    assert got == pytest.approx(noisy(models["a"], 7)[NOISY[0]].flatten()[:10].tolist())


def test_update_from_a_distributed_group(engine: sgl.Engine, models: dict[str, str], restored: None) -> None:
    port = free_port()
    proc, conn = spawn(broadcast_trainer, models["a"], 9, port)
    try:
        engine.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, group_name="trainer",
                                         backend="gloo")
        assert conn.recv() == "joined"
        conn.send("go")
        shapes = [list(t.shape) for t in noisy(models["a"], 9).values()]
        out = engine.update_weights_from_distributed(NOISY, ["float32"] * len(NOISY), shapes, group_name="trainer")
        conn.send("done")
        engine.destroy_weights_update_group("trainer")
    finally:
        proc.join(30)
    assert out["success"] and proc.exitcode == 0
    assert outputs(engine)[0] == hf_greedy(models["a"], PROMPTS, noisy(models["a"], 9))


def test_release_and_resume_memory(engine: sgl.Engine, models: dict[str, str], restored: None) -> None:
    want = outputs(engine)[0]
    engine.release_memory_occupation()
    with pytest.raises(ValueError, match="released"):
        engine.update_weights_from_disk(models["a"])
    with pytest.raises(ValueError, match="released"):
        engine.release_memory_occupation(["kv_cache"])
    engine.resume_memory_occupation()
    assert outputs(engine)[0] == want
    assert_kv_balanced(engine.get_server_info())


def test_a_memory_call_another_rank_failed_is_undone_here(models: dict[str, str]) -> None:
    """Under tensor parallelism every rank releases or resumes, or none does: when another
    rank failed its part, this one undoes its own and raises (a rank that went on alone
    would run collectives the others never join)."""
    from sgl.sched.models.parallel import TPGroup
    from sgl.sched.runner.model_runner import ModelRunner

    r = ModelRunner(sgl.ServerArgs(max_total_tokens=64), models["a"])
    try:
        weights = [p.clone() for p in r.model.parameters()]
        r.tp = other_rank_failed()
        with pytest.raises(RuntimeError, match="another tensor-parallel rank"):
            r.release_memory({"weights", "kv_cache"})
        assert r.released == frozenset()
        assert all(torch.equal(p, w) for p, w in zip(r.model.parameters(), weights, strict=True))
        r.tp = TPGroup()
        r.release_memory({"weights"})
        r.tp = other_rank_failed()
        with pytest.raises(RuntimeError, match="another tensor-parallel rank"):
            r.resume_memory({"weights"})
        assert r.released == frozenset({"weights"})
        r.tp = TPGroup()
        r.resume_memory({"weights"})
        assert all(torch.equal(p, w) for p, w in zip(r.model.parameters(), weights, strict=True))
    finally:
        r.close()


def test_a_recapture_that_failed_on_any_rank_is_undone_on_every_rank(models: dict[str, str]) -> None:
    """Once nothing is released, resume_memory captures the CUDA graphs again; when that
    failed on another rank, this one drops the graphs it captured and releases again, as
    the failed rank does, and raises; when it failed here, the same. (The capture stands in
    for a GPU's; on a GPU each rank's capture runs the model's collectives.)"""
    from sgl.sched.models.parallel import TPGroup
    from sgl.sched.runner.model_runner import ModelRunner

    r = ModelRunner(sgl.ServerArgs(max_total_tokens=64), models["a"])
    try:
        weights = [p.clone() for p in r.model.parameters()]
        r.release_memory({"weights"})
        captured: list[int] = []

        def capture() -> None:
            captured.append(1)
            r.graphs = object()  # type: ignore[assignment]

        r.graph_bs = 2
        r._capture_graphs = capture  # type: ignore[method-assign]
        r.tp = other_rank_failed(only=2)  # the memory's agreement holds, the capture's fails
        with pytest.raises(RuntimeError, match="another tensor-parallel rank"):
            r.resume_memory({"weights"})
        assert captured and r.graphs is None and r.released == frozenset({"weights"})

        def no_memory() -> None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (planted)")

        r.tp = TPGroup()
        r._capture_graphs = no_memory  # type: ignore[method-assign]
        with pytest.raises(torch.cuda.OutOfMemoryError):
            r.resume_memory({"weights"})
        assert r.graphs is None and r.released == frozenset({"weights"})
        r._capture_graphs = capture  # type: ignore[method-assign]
        r.resume_memory({"weights"})
        assert r.graphs is not None and r.released == frozenset()
        assert all(torch.equal(p, w) for p, w in zip(r.model.parameters(), weights, strict=True))
        r.graphs, r.graph_bs = None, None
    finally:
        r.close()


# ---- pausing, on the null model ----

LOAD = 12
LONG = {"temperature": 0.0, "max_new_tokens": 60, "ignore_eos": True}


def run(null_model_dir: str, body: Any) -> None:
    """`body(engine)` on a fresh null-model engine; then its KV accounting balances."""
    async def main() -> None:
        async with sgl.AsyncEngine(null_model_dir, load_format="null", skip_tokenizer_init=True, transport="inproc",
                                   max_total_tokens=2000, max_running_requests=16) as e:
            await asyncio.wait_for(body(e), 120)
            assert_kv_balanced(await e.get_server_info())

    asyncio.run(main())


async def until(e: sgl.AsyncEngine, key: str, n: int) -> dict[str, Any]:
    """Server info once info[key] == n. Each call is a turn of the scheduler's loop, so a
    request sent before it has arrived; bounded by the caller's timeout."""
    while (info := await e.get_server_info())[key] != n:
        await asyncio.sleep(0.005)
    return info


async def collect(engine: sgl.AsyncEngine, prompt: list[int], got: list[int], started: asyncio.Event
                  ) -> dict[str, Any]:
    last: dict[str, Any] = {}
    async for chunk in engine.stream(input_ids=prompt, sampling_params=LONG):
        got.extend(chunk["output_ids"])
        started.set()
        last = chunk
    return last["meta_info"]


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_under_streaming_load(null_model_dir: str, mode: str) -> None:
    async def body(e: sgl.AsyncEngine) -> None:
        prompts = [[i + 1, i + 2] for i in range(LOAD)]
        got: list[list[int]] = [[] for _ in prompts]
        started = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(collect(e, p, g, s)) for p, g, s in zip(prompts, got, started)]
        await asyncio.gather(*(s.wait() for s in started))  # every stream has its first tokens
        await e.pause_generation(mode=mode)
        seen = [len(g) for g in got]  # outputs sent before the answer arrived before it
        late = asyncio.create_task(e.generate(input_ids=[7, 8], sampling_params={**LONG, "max_new_tokens": 3}))
        info = await until(e, "waiting", {"in_place": 1, "retract": LOAD + 1, "abort": 1}[mode])
        assert [len(g) for g in got] == seen, "tokens arrived while paused"
        assert info["running"] == (LOAD if mode == "in_place" else 0) and not late.done()
        assert info["paused"] == mode
        await e.continue_generation()
        metas = await asyncio.gather(*tasks)
        assert (await late)["output_ids"] == null_continuation(8, 3)
        for p, g, m in zip(prompts, got, metas):
            want = null_continuation(p[-1], LONG["max_new_tokens"])
            if mode == "abort":
                assert m["finish_reason"]["type"] == "abort" and g == want[: len(g)]
            else:
                assert m["finish_reason"]["type"] == "length" and g == want

    run(null_model_dir, body)


def test_refusal_abort_all_and_released_memory(null_model_dir: str) -> None:
    async def body(e: sgl.AsyncEngine) -> None:
        # Paused with refuse_new: a new request is refused at once (a 503 over HTTP).
        await e.pause_generation(mode="in_place", refuse_new=True)
        with pytest.raises(ServerBusyError, match="paused"):
            await e.generate(input_ids=[1], sampling_params=LONG)
        await e.continue_generation()
        await e.continue_generation()  # continuing a running engine is no error
        # abort_all ends every request, queued ones too (paused: none can finish first).
        await e.pause_generation(mode="in_place")
        tasks = [asyncio.create_task(e.generate(input_ids=[i + 3], sampling_params=LONG)) for i in range(5)]
        await until(e, "waiting", 5)
        assert (await e.abort_all()) == 5
        outs = await asyncio.gather(*tasks)
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
        await e.continue_generation()
        # With the KV pool released a request waits; it runs once the pool is back.
        await e.release_memory_occupation(["kv_cache"])
        late = asyncio.create_task(e.generate(input_ids=[4], sampling_params={**LONG, "max_new_tokens": 3}))
        info = await until(e, "waiting", 1)
        assert info["memory_released"] == ["kv_cache"] and not late.done()
        await e.resume_memory_occupation(["kv_cache"])
        assert (await late)["output_ids"] == null_continuation(4, 3)
        assert (await e.generate(input_ids=[1], sampling_params={**LONG, "max_new_tokens": 2}))["output_ids"] == \
            null_continuation(1, 2)

    run(null_model_dir, body)
