"""An engine used as a library leaves the process as it found it: os.environ, the
root logger, structlog's configuration, torch's thread count, the GIL's switch
interval, and no thread of its own (nor tqdm's monitor) alive once `async with
sgl.AsyncEngine(...)` has exited. Process-wide settings are made only in sgl's own
child processes."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import structlog
import torch

import sgl
from sgl.sched.models.default_model import default_model_dir


def _ours(besides: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """sgl's threads (and tqdm's monitor) alive now, other than `besides` (threads an
    earlier test in this process left)."""
    return [t.name for t in threading.enumerate() if t not in besides and (
        t.name.startswith("sgl") or t.name == "monitor" or type(t).__name__ == "TMonitor")]


def test_engine_leaves_no_trace() -> None:
    model = default_model_dir()
    env = dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configured = structlog.is_configured()
    before = frozenset(threading.enumerate())
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()

    async def main() -> None:
        async with sgl.AsyncEngine(model, transport="inproc") as e:
            out = await e.generate("Hello", {"max_new_tokens": 2})
            assert out["meta_info"]["completion_tokens"] >= 1

    asyncio.run(main())
    assert dict(os.environ) == env
    assert root.handlers == handlers and root.level == level
    assert structlog.is_configured() == configured
    assert (torch.get_num_threads(), sys.getswitchinterval()) == (threads, interval)
    for _ in range(50):  # a thread may take a moment to return after being joined with a timeout
        if not _ours(before):
            break
        time.sleep(0.1)
    assert not _ours(before), _ours(before)


@pytest.mark.parametrize("omp", [None, "3"])
def test_a_gpu_schedulers_process_runs_host_ops_on_one_thread_unless_told(omp: str | None) -> None:
    """sgl.runtime.child.single_threaded_host_ops, in a fresh interpreter as a child
    role is: one intra-op thread, or what torch made of OMP_NUM_THREADS, left alone."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    code = ("import torch; from sgl.runtime.child import single_threaded_host_ops as f; "
            "before = torch.get_num_threads(); f(); print(before, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert after == (1 if omp is None else before)
