"""Liveness and shutdown, with real processes and sockets: /health answers at once
while the scheduler is busy in a long prefill and says 503 once a role died; a
dead scheduler makes `sgl serve` fail its open streams and exit non-zero, with no
child left; Ctrl-C / SIGTERM stop a starting server at once, and a serving one
after ending every open stream with an error event and `data: [DONE]`; SIGTERM
of a script that uses `Engine` leaves no socket folder behind.

Every wait polls with a deadline. Servers get their own TMPDIR, so the socket
folder they leave (or not) is theirs alone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import sgl
from sgl.sched.models.default_model import default_model_dir
from sgl.server.serve import GRACEFUL_SHUTDOWN_S
from tests.conftest import null_continuation
from tests.serve_util import ServerProc, alive, child_pids, exists

SIGNALS = [pytest.param(signal.SIGINT, id="SIGINT"), pytest.param(signal.SIGTERM, id="SIGTERM")]
LONG = {"max_new_tokens": 7000, "ignore_eos": True}
PREFILL_TOKENS = 1000


NAME = "m"  # the served model name


def _null_server(tmp_path: Path, *flags: str) -> ServerProc:
    """The null model over SmolLM2's config and tokenizer: instant start, endless streams."""
    return ServerProc("--model-path", default_model_dir(), "--load-format", "null", "--max-total-tokens", "16000",
                      "--served-model-name", NAME, *flags, stderr_path=str(tmp_path / "stderr"),
                      env={"TMPDIR": str(tmp_path)})


def _socket_dirs(tmp_path: Path) -> list[Path]:
    return list(tmp_path.glob("sgl-*"))


def _exit_code(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(max(0.0, timeout))
    except subprocess.TimeoutExpired:
        return None


def _first_event(lines: Any) -> str:
    first = next(line for line in lines if line)
    assert first.startswith("data: {") and '"error"' not in first, first
    return first


def _assert_error_then_done(events: list[str]) -> dict[str, Any]:
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2].removeprefix("data: "))
    assert set(err) == {"error"}, events[-3:]
    return err["error"]


def _wait_until(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_health_answers_at_once_during_a_long_prefill(tmp_path: Path) -> None:
    # The real model on the CPU, no chunking: one forward over the whole prompt takes seconds.
    s = ServerProc("--model-path", default_model_dir(), "--skip-tokenizer-init", "--max-total-tokens", "4000",
                   env={"TMPDIR": str(tmp_path)})
    try:
        ids = [100 + (i * 7919) % 40000 for i in range(PREFILL_TOKENS)]
        done: dict[str, Any] = {}

        def generate() -> None:
            r = httpx.post(s.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}},
                           timeout=600)
            done["status"] = r.status_code

        request = threading.Thread(target=generate)
        request.start()
        probes: list[tuple[int | None, float]] = []
        with httpx.Client(timeout=1.0) as c:
            while request.is_alive():
                t0 = time.monotonic()
                try:
                    status: int | None = c.get(s.url + "/health").status_code
                except httpx.TimeoutException:
                    status = None
                probes.append((status, time.monotonic() - t0))
                request.join(0.05)
        assert done["status"] == 200
        assert len(probes) >= 5, f"the prefill was too short to probe: {probes}"
        slow = [(st, round(dt, 2)) for st, dt in probes if st != 200 or dt >= 1.0]
        assert not slow, f"{len(slow)} of {len(probes)} probes failed or took >= 1 s: {slow}"
    finally:
        s.stop()


def test_health_says_503_once_a_role_died(null_model_dir: str) -> None:
    from sgl.server.app import build_app

    before = set(child_pids(os.getpid()))  # another module's shared server may be running

    async def main() -> None:
        engine = await sgl.AsyncEngine.start(null_model_dir, transport="ipc", load_format="null",
                                             skip_tokenizer_init=True, max_total_tokens=100)
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://sgl") as c:
            assert (await c.get("/health")).status_code == 200
            os.kill(engine.roles.pids()["scheduler"], signal.SIGKILL)
            deadline = time.monotonic() + 5
            while (r := await c.get("/health")).status_code == 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert r.status_code == 503
            assert "scheduler" in r.json()["error"]["message"]
        await engine.aclose()

    asyncio.run(main())
    assert _wait_until(lambda: set(child_pids(os.getpid())) <= before, 5), "a child process was left behind"


def test_awaitable_start_serves_and_a_cancelled_one_leaves_nothing(null_model_dir: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kwargs = {"transport": "ipc", "load_format": "null", "skip_tokenizer_init": True, "max_total_tokens": 100}

    before = set(child_pids(os.getpid()))  # another module's shared server may be running

    def new_kids() -> list[int]:
        return [k for k in child_pids(os.getpid()) if k not in before]

    async def main() -> None:
        async with await sgl.AsyncEngine.start(null_model_dir, **kwargs) as e:
            out = await e.generate(input_ids=[5], sampling_params={"temperature": 0, "max_new_tokens": 3})
            assert out["output_ids"] == null_continuation(5, 3)
        starting = asyncio.ensure_future(sgl.AsyncEngine.start(null_model_dir, **kwargs))
        deadline = time.monotonic() + 30
        while len(new_kids()) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        kids = new_kids()
        assert len(kids) == 2 and not starting.done()
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert not any(exists(k) for k in kids), "a cancelled start left a child process"

    asyncio.run(main())
    assert _socket_dirs(tmp_path) == []


def test_a_dead_scheduler_fails_open_streams_and_the_server_exits_non_zero(tmp_path: Path) -> None:
    s = _null_server(tmp_path, "--skip-tokenizer-init")
    try:
        pids = s.info()["role_pids"]
        with httpx.stream("POST", s.url + "/generate", json={"input_ids": [1], "stream": True, "sampling_params": LONG},
                          timeout=30) as r:
            lines = r.iter_lines()
            first = _first_event(lines)
            os.kill(pids["scheduler"], signal.SIGKILL)
            t0 = time.monotonic()
            events = [first, *(line for line in lines if line)]
        err = _assert_error_then_done(events)
        assert err["type"] == "service_unavailable_error" and "scheduler" in err["message"], err
        code = _exit_code(s.proc, 5 - (time.monotonic() - t0))
        assert code is not None, "the server still runs 5 s after its scheduler died"
        assert code != 0
        assert not any(exists(p) for p in pids.values()), "a role is left (alive or a zombie)"
        assert _socket_dirs(tmp_path) == []
    finally:
        s.stop()


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_during_start_up_stops_at_once(tmp_path: Path, sig: int) -> None:
    # The real model on the CPU: its roles take seconds to load.
    s = ServerProc("--model-path", default_model_dir(), "--max-total-tokens", "2000", wait=False,
                   stderr_path=str(tmp_path / "stderr"), env={"TMPDIR": str(tmp_path)})
    try:
        assert s.wait_output("sgl serve: starting")
        assert _wait_until(lambda: len(child_pids(s.proc.pid)) == 2, 60), "the roles were never started"
        kids = child_pids(s.proc.pid)
        s.proc.send_signal(sig)
        code = _exit_code(s.proc, 3)
        assert code is not None, "still running 3 s after the signal"
        assert code == 128 + sig
        assert not s.wait_output("ready on ", 2), "the start-up ended before the signal: nothing was tested"
        assert not any(exists(k) for k in kids), "a role is left (alive or a zombie)"
        assert _socket_dirs(tmp_path) == []
        stderr = (tmp_path / "stderr").read_text()
        assert "Traceback" not in stderr, stderr
    finally:
        s.stop()


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_ends_open_streams_with_an_error_event(tmp_path: Path, sig: int) -> None:
    s = _null_server(tmp_path)
    try:
        pids = s.info()["role_pids"]
        oai_body = {"model": NAME, "prompt": "Hello", "max_tokens": LONG["max_new_tokens"], "ignore_eos": True,
                    "stream": True}
        native_body = {"text": "Hello", "stream": True, "sampling_params": LONG}
        with httpx.Client(base_url=s.url, timeout=30) as c, \
                c.stream("POST", "/v1/completions", json=oai_body) as oai, \
                c.stream("POST", "/generate", json=native_body) as native:
            streams = [oai.iter_lines(), native.iter_lines()]
            firsts = [_first_event(lines) for lines in streams]
            s.proc.send_signal(sig)
            t0 = time.monotonic()
            events = [[first, *(line for line in lines if line)] for first, lines in zip(firsts, streams)]
        for ev in events:
            err = _assert_error_then_done(ev)
            assert err["type"] == "service_unavailable_error" and "shutting down" in err["message"], err
        assert _exit_code(s.proc, GRACEFUL_SHUTDOWN_S + 10 - (time.monotonic() - t0)) == 0
        assert not any(exists(p) for p in pids.values()), "a role is left (alive or a zombie)"
        assert _socket_dirs(tmp_path) == []
        stderr = (tmp_path / "stderr").read_text()
        assert "Traceback" not in stderr, stderr
    finally:
        s.stop()


def test_sigterm_of_an_engine_script_removes_its_socket_folder(tmp_path: Path, null_model_dir: str) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import time
        import sgl
        engine = sgl.Engine({null_model_dir!r}, transport="ipc", load_format="null", skip_tokenizer_init=True,
                            max_total_tokens=100)
        print(engine._engine.roles.addresses.ipc_dir, *engine._engine.roles.pids().values(), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        assert proc.stdout is not None
        ipc_dir, *pids = proc.stdout.readline().split()
        assert ipc_dir.startswith(str(tmp)) and os.path.isdir(ipc_dir)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM
        assert _wait_until(lambda: not os.path.exists(ipc_dir), 5), f"{ipc_dir} is left behind"
        assert _wait_until(lambda: not any(alive(int(p)) for p in pids), 5), "a role outlived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
