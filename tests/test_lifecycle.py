"""Process life: startup errors reach the caller (a role's at once, whatever another
role waits on), a dead scheduler fails every pending request within 5 seconds, nothing
is left behind, and a plain script without a __main__ guard works as written."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import sgl
from sgl.core.server_args import ServerArgs
from sgl.runtime.engine_roles import EngineRoles, find_model_files
from sgl.runtime.launch import ChildStartupError, RoleHandle
from sgl.runtime.tokenizer_manager import EngineDeadError
from tests.conftest import null_continuation


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    out.append(int(entry))
            except OSError:
                pass
    return out


def test_bad_model_path_raises_in_caller() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sgl.Engine("/no/such/model", transport="ipc")


@pytest.mark.parametrize("transport", ["ipc", "inproc"])
def test_loader_error_in_the_scheduler_reaches_the_caller(tmp_path, transport: str) -> None:
    (tmp_path / "config.json").write_text(
        '{"architectures": ["NoSuchForCausalLM"], "model_type": "llama", "vocab_size": 10}'
    )
    before = set(_children_of(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(Exception, match="NoSuchForCausalLM"):
        sgl.Engine(str(tmp_path), transport=transport, skip_tokenizer_init=True)
    assert time.monotonic() - t0 < 60
    assert set(_children_of(os.getpid())) <= before, "a child process was left behind"


class _Waiting(RoleHandle):
    """A role that never reports: a tensor-parallel rank left in a collective its peer quit."""

    def __init__(self) -> None:
        self.name, self.killed = "scheduler-tp0", False

    def alive(self) -> bool:
        return not self.killed

    def poll_ready(self) -> dict | None:
        return None

    def kill(self) -> None:
        self.killed = True

    def stop(self, timeout: float) -> None:
        pass


class _Failed(_Waiting):
    """Its peer, failed inside a CUDA graph's warm-up."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "scheduler-tp1"

    def poll_ready(self) -> dict | None:
        raise ChildStartupError("the scheduler-tp1 failed in a CUDA graph's warm-up: out of memory")


@pytest.mark.parametrize("wait", ["blocking", "on a loop"])
def test_a_role_failing_while_another_waits_on_it_ends_the_start(null_model_dir: str, wait: str) -> None:
    """Roles that wait on each other (tensor-parallel ranks meet in collectives): one
    failing while the first listed waits on it for good ends the start at once with its
    error, the waiting role killed and the engine's real roles stopped, whichever way the
    start waits (Engine's blocking start, or AsyncEngine.start on a loop)."""
    args = ServerArgs.from_kwargs(model_path=null_model_dir, transport="inproc", load_format="null",
                                  skip_tokenizer_init=True, max_total_tokens=4000)
    roles = EngineRoles(args, find_model_files(args))
    waiting, failed = _Waiting(), _Failed()
    real = list(roles.handles)
    roles.handles = [waiting, *real, failed]
    t0 = time.monotonic()
    with pytest.raises(ChildStartupError, match="warm-up"):
        roles.wait_ready() if wait == "blocking" else asyncio.run(roles.ready())
    assert time.monotonic() - t0 < 10
    assert waiting.killed
    for h in real:
        h.stop(30)  # asked to stop by the failed start: each ends at its next read
        assert not h.alive()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_killing_the_scheduler_fails_pending_requests(null_model_dir: str, transport: str) -> None:
    # The children of earlier tests that outlive them by design (multiprocessing's resource
    # tracker, started by a shared-memory block) are not this engine's.
    before = set(_children_of(os.getpid()))
    engine = sgl.AsyncEngine(null_model_dir, transport=transport, load_format="null", skip_tokenizer_init=True,
                             max_total_tokens=4000)
    sched_pid = engine.roles.pids()["scheduler"]
    params = {"temperature": 0, "max_new_tokens": 511, "ignore_eos": True}  # the whole context of 512

    async def main() -> None:
        # A long context keeps them running until the kill.
        tasks = [asyncio.create_task(engine.generate(input_ids=[i + 1], sampling_params=params)) for i in range(8)]
        stream = engine.stream(input_ids=[3], sampling_params=params)
        await stream.__anext__()
        os.kill(sched_pid, signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert time.monotonic() - t0 < 5
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "scheduler" in str(results[0])
        with pytest.raises(EngineDeadError):
            await engine.generate(input_ids=[1])
        await engine.aclose()

    asyncio.run(main())
    time.sleep(0.2)
    assert set(_children_of(os.getpid())) <= before, "a child process was left behind"
    assert not engine.roles.addresses.ipc_dir or not os.path.exists(engine.roles.addresses.ipc_dir)


def test_script_without_main_guard(tmp_path, null_model_dir: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import sgl
        engine = sgl.Engine({null_model_dir!r}, load_format="null", skip_tokenizer_init=True, max_total_tokens=100)
        out = engine.generate(input_ids=[5], sampling_params={{"temperature": 0, "max_new_tokens": 3}})
        print("OUT", out["output_ids"])
    """))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"OUT {null_continuation(5, 3)}" in res.stdout


def test_children_exit_when_the_parent_is_killed(tmp_path, null_model_dir: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        import sgl
        engine = sgl.Engine({null_model_dir!r}, load_format="null", skip_tokenizer_init=True, max_total_tokens=100)
        print(*engine._engine.roles.pids().values(), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
