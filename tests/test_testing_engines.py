"""sgl.testing's real engines: the null model gives its documented continuation through
text and ids, over the async helper, its sync twin and the BackgroundEngine that the
pytest plugin's `sgl_null_engine` is; a BackgroundEngine serves any loop, keeps the
engine's cancellation and errors, and has AsyncEngine's calls."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

import sgl
from sgl.sched.models.null import NullModel, null_next_token
from sgl.testing import DeviceTime
from sgl.testing.contract import assert_no_leaks
from sgl.testing.engines import (
    PLAIN_VOCAB,
    TOKENIZER_EOS,
    BackgroundEngine,
    EngineRecipe,
    null_continuation,
    null_engine,
    null_model_dir,
    null_sync_engine,
    server_info_when_idle,
)

PROMPT = "The null model says"


def test_null_continuation_iterates_the_models_rule() -> None:
    assert null_continuation(10, 3, 1000) == [71, 498, 487]
    chain = null_continuation(123, 20)
    assert chain[0] == null_next_token(123, 49_152)
    assert all(null_next_token(a, 49_152) == b for a, b in zip(chain, chain[1:]))


def test_null_model_dir_writes_a_config_and_the_default_tokenizer(tmp_path: Path) -> None:
    d = Path(null_model_dir(tmp_path / "m"))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in d.iterdir()}
    assert json.loads((d / "config.json").read_text())["eos_token_id"] == TOKENIZER_EOS
    plain = Path(null_model_dir(tmp_path / "plain", with_tokenizer=False))
    assert not (plain / "tokenizer.json").exists()
    cfg = json.loads((plain / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["eos_token_id"]) == (PLAIN_VOCAB, PLAIN_VOCAB - 1)
    with pytest.raises(ValueError, match="vocab_size"):
        null_model_dir(tmp_path / "small", vocab_size=1000)


def test_the_async_helper_gives_the_continuation_through_text_and_ids() -> None:
    async def main() -> tuple[Any, ...]:
        async with null_engine() as engine:
            assert isinstance(engine, sgl.AsyncEngine) and engine.args.transport == "inproc"
            by_text = await engine.generate(PROMPT, {"max_new_tokens": 6})
            by_ids = await engine.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 5})
            chunks = [c async for c in engine.stream(PROMPT, {"max_new_tokens": 6})]
            prompt_ids = engine.tokenizer.encode(PROMPT)
            text = engine.tokenizer.decode(null_continuation(prompt_ids[-1], 6), skip_special_tokens=True)
            assert_no_leaks(await server_info_when_idle(engine))
            return by_text, by_ids, chunks, prompt_ids, text

    by_text, by_ids, chunks, prompt_ids, text = asyncio.run(main())
    assert by_text["output_ids"] == null_continuation(prompt_ids[-1], 6)
    assert by_text["text"] == text
    assert by_text["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert by_ids["output_ids"] == null_continuation(8, 5)
    assert "".join(c["text"] for c in chunks) == text


def test_the_sync_twin_and_the_end_of_sequence_id() -> None:
    before_eos = next(t for t in range(49_152) if null_next_token(t, 49_152) == TOKENIZER_EOS)
    with null_sync_engine(max_total_tokens=1024) as engine:
        assert isinstance(engine, sgl.Engine)
        out = engine.generate(PROMPT, {"max_new_tokens": 4})
        last_prompt_id = engine.tokenizer.encode(PROMPT)[-1]
        stopped = engine.generate(input_ids=[before_eos], sampling_params={"max_new_tokens": 4})
        info = engine.get_server_info()
    assert out["output_ids"] == null_continuation(last_prompt_id, 4)
    assert stopped["output_ids"] == [TOKENIZER_EOS]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": TOKENIZER_EOS}
    assert info["max_total_tokens"] == 1024
    assert_no_leaks(info)


def test_without_a_tokenizer_ids_in_ids_out(tmp_path: Path) -> None:
    model = null_model_dir(tmp_path, with_tokenizer=False)

    async def main() -> Any:
        async with null_engine(model_path=model, skip_tokenizer_init=True) as engine:
            out = await engine.generate(input_ids=[3, 4], sampling_params={"max_new_tokens": 5, "ignore_eos": True})
            assert_no_leaks(await server_info_when_idle(engine))
            return out

    assert asyncio.run(main())["output_ids"] == null_continuation(4, 5, PLAIN_VOCAB)


# ---- a null model whose forwards take time --------------------------------------------

DECODE_MS = 20.0  # far above a null decode step's host work (a fraction of a ms)


@pytest.mark.parametrize("overlap", [False, True])
def test_device_time_makes_each_forward_take_its_time_and_the_overlap_loop_hides_the_host(overlap: bool) -> None:
    """Each forward sleeps its DeviceTime on the forward's thread: outputs are unchanged,
    no step is shorter than the time set, and the loop's host work runs beside the forward
    under the overlap loop (the turn's build does not hold it) and around it without."""
    timing = DeviceTime(decode_ms=DECODE_MS, prefill_ms=2 * DECODE_MS, per_token_us=0.0)
    new = 8
    with null_sync_engine(device_time=timing, disable_overlap_schedule=not overlap, skip_tokenizer_init=True) as e:
        before = e.get_server_info()
        t0 = time.perf_counter()
        outs = e.generate(input_ids=[[5, 6], [7, 8]], sampling_params={"max_new_tokens": new, "ignore_eos": True})
        wall = time.perf_counter() - t0
        info = e.get_server_info()
    assert [o["output_ids"] for o in outs] == [null_continuation(6, new), null_continuation(8, new)]
    steps = info["decode_steps"] - before["decode_steps"]
    assert steps >= new - 1
    assert wall >= (2 * DECODE_MS + steps * DECODE_MS) / 1e3  # a prefill forward at least, and each step
    build_per_step = (info["build_s"] - before["build_s"]) / steps
    if overlap:
        assert build_per_step < DECODE_MS / 2 / 1e3  # the forward is waited for, not run, by the turn
    else:
        assert build_per_step >= DECODE_MS / 1e3  # the turn runs the forward itself


def test_device_time_is_checked_and_read_back() -> None:
    t = DeviceTime(decode_ms=1.0, prefill_ms=2.0, per_token_us=3.0)
    assert math.isclose(t.seconds(True, 10), 1.03e-3) and math.isclose(t.seconds(False, 1000), 5e-3)
    assert DeviceTime.from_config(t.to_config()) == t and DeviceTime.from_config(None) is None
    for bad in ({"decode_ms": -1.0}, {"prefill_ms": math.nan}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DeviceTime(**bad)
    for entry in ({"decode": 1.0}, {"decode_ms": "fast"}, [1.0]):
        with pytest.raises(ValueError, match="sgl_null_device_time"):
            DeviceTime.from_config(entry)
    import torch

    with pytest.raises(ValueError, match="device='cpu'"):
        NullModel(1000, torch.device("meta"), t)
    with pytest.raises(ValueError, match="null_model_dir"):
        EngineRecipe.null_model(model_path="/some/dir", device_time=t)


def test_null_model_dir_writes_the_device_time(tmp_path: Path) -> None:
    t = DeviceTime(decode_ms=0.5)
    cfg = json.loads((Path(null_model_dir(tmp_path, with_tokenizer=False, device_time=t)) / "config.json").read_text())
    assert DeviceTime.from_config(cfg[DeviceTime.CONFIG_KEY]) == t


# ---- BackgroundEngine, as the plugin's sgl_null_engine gives it ----------------------

def test_a_background_engine_serves_a_new_loop_each_time(sgl_null_engine: BackgroundEngine) -> None:
    async def once() -> Any:
        return await sgl_null_engine.generate(input_ids=[11], sampling_params={"max_new_tokens": 3})

    # An AsyncEngine stays bound to the first loop that used it; this one takes any.
    assert asyncio.run(once())["output_ids"] == asyncio.run(once())["output_ids"] == null_continuation(11, 3)


def test_errors_cross_to_the_callers_loop(sgl_null_engine: BackgroundEngine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="temperature"):
            await sgl_null_engine.generate(PROMPT, {"temperature": -1})
        with pytest.raises(ValueError, match="max_new_tokens"):
            async for _ in sgl_null_engine.stream(PROMPT, {"max_new_tokens": -2}):
                pass

    asyncio.run(main())


def test_cancelling_a_call_or_leaving_a_stream_aborts_it(sgl_null_engine: BackgroundEngine) -> None:
    endless = {"max_new_tokens": 8000, "ignore_eos": True}

    async def main() -> None:
        call = asyncio.ensure_future(sgl_null_engine.generate(input_ids=[1], sampling_params=endless, rid="call"))
        async for _ in sgl_null_engine.stream(input_ids=[2], sampling_params=endless, rid="stream"):
            break
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())
    info = sgl_null_engine.idle_server_info()
    # Both ended early: 16,000 tokens would have taken far more decode steps than the two requests ran.
    assert info["decode_steps"] < 8000
    assert_no_leaks(info)


def test_a_background_engine_has_the_async_engines_calls() -> None:
    for name in ("generate", "stream", "abort", "flush_cache", "get_server_info", "health", "aclose", "__aexit__"):
        ours, theirs = getattr(BackgroundEngine, name), getattr(sgl.AsyncEngine, name)
        assert inspect.signature(ours) == inspect.signature(theirs), name
        assert inspect.isasyncgenfunction(ours) == inspect.isasyncgenfunction(theirs), name
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs), name
    assert inspect.iscoroutinefunction(BackgroundEngine.__aenter__)
