"""An engine used as a library leaves the process as it found it: os.environ, the
root logger, structlog's configuration, and no thread of its own (nor tqdm's
monitor) alive once `async with sgl.AsyncEngine(...)` has exited."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import structlog

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

    async def main() -> None:
        async with sgl.AsyncEngine(model, transport="inproc") as e:
            out = await e.generate("Hello", {"max_new_tokens": 2})
            assert out["meta_info"]["completion_tokens"] >= 1

    asyncio.run(main())
    assert dict(os.environ) == env
    assert root.handlers == handlers and root.level == level
    assert structlog.is_configured() == configured
    for _ in range(50):  # a thread may take a moment to return after being joined with a timeout
        if not _ours(before):
            break
        time.sleep(0.1)
    assert not _ours(before), _ours(before)
