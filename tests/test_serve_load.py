"""`sgl serve` under load and under failure, on loopback with the null model over
the tcp transport: 500 concurrent streaming HTTP requests arrive whole and in
order while random clients hang up mid-stream (leaking no KV slot); a scheduler
killed under load turns every open request, over HTTP and on an attached
AsyncEngine, into an error within 5 seconds, and the server still shuts down
cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import sgl
from sgl.runtime.tokenizer_manager import EngineDeadError
from tests.conftest import null_continuation
from tests.serve_util import ServerProc, alive

N_STREAMS = 500
N_DISCONNECTS = 100
NEW_TOKENS = 12
TRANSPORT_KEY = "9a" * 32


@pytest.fixture
def server(null_model_dir: str) -> Iterator[ServerProc]:
    s = ServerProc("--model-path", null_model_dir, "--load-format", "null", "--skip-tokenizer-init",
                   "--transport", "tcp", "--transport-key", TRANSPORT_KEY,
                   "--max-total-tokens", "30000", "--max-running-requests", "256", "--context-length", "8192")
    yield s
    code = s.stop(signal.SIGTERM)
    assert code == 0 or (code > 0 and getattr(s, "scheduler_killed", False)), code


async def _events(r: httpx.Response) -> Any:
    async for line in r.aiter_lines():
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


async def _full_stream(client: httpx.AsyncClient, i: int) -> tuple[list[int], list[Any]]:
    prompt = [1 + i % 900, 1 + (i * 7) % 900]
    body = {"input_ids": prompt, "stream": True, "rid": f"load-{i}",
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        return prompt, [e async for e in _events(r)]


async def _hang_up(client: httpx.AsyncClient, i: int, after: int) -> None:
    body = {"input_ids": [1 + i % 900], "stream": True,
            "sampling_params": {"max_new_tokens": 5000, "temperature": 0, "ignore_eos": True}}
    async with client.stream("POST", "/generate", json=body) as r:
        n = 0
        async for _ in _events(r):
            n += 1
            if n >= after:
                break  # leaving the block closes the connection mid-stream


def test_500_concurrent_streams_with_random_disconnects(server: ServerProc) -> None:
    rng = random.Random(6)
    steps_before = server.info()["decode_steps"]

    async def main() -> list[tuple[list[int], list[Any]]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            full = [asyncio.create_task(_full_stream(client, i)) for i in range(N_STREAMS)]
            quits = [asyncio.create_task(_hang_up(client, i, rng.randint(1, 4))) for i in range(N_DISCONNECTS)]
            await asyncio.wait_for(asyncio.gather(*quits), 120)
            return await asyncio.wait_for(asyncio.gather(*full), 120)

    results = asyncio.run(main())
    assert len(results) == N_STREAMS
    for i, (prompt, events) in enumerate(results):
        assert events[-1] == "[DONE]", i
        chunks = events[:-1]
        assert all(c["meta_info"]["id"] == f"load-{i}" for c in chunks)
        # SGLang's native streaming: each chunk holds the output so far, growing to the whole.
        assert all(a["output_ids"] == b["output_ids"][: len(a["output_ids"])] for a, b in zip(chunks, chunks[1:])), i
        assert chunks[-1]["output_ids"] == null_continuation(prompt[-1], NEW_TOKENS), i
        counts = [c["meta_info"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == NEW_TOKENS
        assert [c["meta_info"]["finish_reason"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    info = server.wait_idle(timeout=15)
    assert info["kv_free"] + info["kv_evictable"] == info["max_total_tokens"], info
    server.assert_balanced()
    # Had a hung-up stream run on, it alone would have taken 5000 decode steps.
    assert info["decode_steps"] - steps_before < 4000, info["decode_steps"] - steps_before
    metrics = server.get("/metrics").text
    ttft_count = next(ln for ln in metrics.splitlines() if ln.startswith("sgl_time_to_first_token_seconds_count"))
    assert int(float(ttft_count.split()[1])) >= N_STREAMS


def test_killing_the_scheduler_under_load_fails_every_request(server: ServerProc) -> None:
    pids = server.info()["role_pids"]
    server.scheduler_killed = True  # type: ignore[attr-defined]  # its exit code is then non-zero
    params = {"max_new_tokens": 8000, "temperature": 0, "ignore_eos": True}  # near the context of 8192

    async def stream_until_error(client: httpx.AsyncClient, i: int, started: asyncio.Event,
                                 n_started: list[int]) -> float:
        body = {"input_ids": [1 + i], "stream": True, "sampling_params": params}
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:  # failed before its first token: a plain error response
                await r.aread()
                assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"], r.text[:300]
                return time.monotonic()
            first = True
            async for e in _events(r):
                if first:
                    first = False
                    n_started[0] += 1
                    if n_started[0] == 10:  # the rest may still queue: they must fail too
                        started.set()
                if isinstance(e, dict) and "error" in e:
                    assert e["error"]["type"] == "service_unavailable_error" and "scheduler" in e["error"]["message"]
                    return time.monotonic()
        raise AssertionError("stream ended without an error")

    async def plain(client: httpx.AsyncClient, i: int) -> float:
        r = await client.post("/generate", json={"input_ids": [1 + i], "sampling_params": params})
        assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"], r.text[:300]
        return time.monotonic()

    async def attached_until_error(engine: sgl.AsyncEngine) -> float:
        with pytest.raises(EngineDeadError):
            async for _ in engine.stream(input_ids=[7], sampling_params=params):
                pass
        return time.monotonic()

    async def main() -> None:
        started = asyncio.Event()
        n_started = [0]
        limits = httpx.Limits(max_connections=None)
        # Default heartbeat: a server gone is noticed within heartbeat_interval + timeout.
        engine = await sgl.AsyncEngine.connect(server.scheduler_address, transport_key=TRANSPORT_KEY,
                                               skip_tokenizer_init=True)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
            streams = [asyncio.create_task(stream_until_error(client, i, started, n_started)) for i in range(30)]
            plains = [asyncio.create_task(plain(client, 100 + i)) for i in range(20)]
            attached = asyncio.create_task(attached_until_error(engine))
            await asyncio.wait_for(started.wait(), 60)
            os.kill(pids["scheduler"], signal.SIGKILL)
            t0 = time.monotonic()
            ends = await asyncio.wait_for(asyncio.gather(*streams, *plains), 30)
            assert max(ends) - t0 < 5.0, max(ends) - t0
            # Then the server exits non-zero, so that a supervisor restarts it.
            while server.proc.poll() is None and time.monotonic() - t0 < 5.0:
                await asyncio.sleep(0.05)
            assert server.proc.poll() not in (None, 0), "the server kept running without its scheduler"
            # The attached engine has no watchdog: its heartbeat notices, within 5 s.
            assert await asyncio.wait_for(attached, 30) - t0 < 5.0
        await engine.aclose()

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(pids["detokenizer"]):
        time.sleep(0.05)
    assert not alive(pids["detokenizer"])
