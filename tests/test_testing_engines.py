"""sgl.testing's real engines: the null model gives its documented continuation through
text and ids, over the async helper, its sync twin and the BackgroundEngine that the
pytest plugin's `sgl_null_engine` is; a BackgroundEngine serves any loop, keeps the
engine's cancellation and errors, and has AsyncEngine's calls."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

import sgl
from sgl.sched.models.null import null_next_token
from sgl.testing.contract import assert_no_leaks
from sgl.testing.engines import (
    PLAIN_VOCAB,
    TOKENIZER_EOS,
    BackgroundEngine,
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
