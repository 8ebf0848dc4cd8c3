"""Starting and watching the child roles.

Processes are fresh interpreters (`python -m sgl.runtime.child`), never forks: the
caller's main module is not re-imported, so no `__main__` guard is needed, and a
CUDA-initialised caller is safe. Under the inproc transport the roles run on
daemon threads instead. Either way the caller waits for each role's readiness
report and re-raises its startup error; afterwards a watchdog turns a dead role
into one callback, never a hang."""

from __future__ import annotations

import builtins
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import msgspec

from sgl.runtime.roles import ChildConfig, run_role


class ChildStartupError(RuntimeError):
    """A role failed to start and its error type is not a built-in exception."""


class RoleHandle(ABC):
    name: str

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def wait_ready(self) -> dict[str, Any]:
        """Block until the role reports; return its info or raise its startup error."""

    @abstractmethod
    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` for a clean exit, then force it."""

    def exit_description(self) -> str:
        return "stopped"


class ProcessRole(RoleHandle):
    def __init__(self, cfg: ChildConfig) -> None:
        self.name = cfg.role
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sgl.runtime.child", str(w)],
            stdin=subprocess.PIPE,
            pass_fds=(w,),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        os.close(w)
        self._ready_r = r
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(cfg) + b"\n")
        self.proc.stdin.flush()  # stdin stays open: its end-of-file tells the child we are gone

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_description(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def wait_ready(self) -> dict[str, Any]:
        buf = b""
        try:
            while True:
                ready, _, _ = select.select([self._ready_r], [], [], 0.2)
                if ready:
                    chunk = os.read(self._ready_r, 65536)
                    if not chunk:
                        break
                    buf += chunk
                    if buf.endswith(b"\n"):
                        break
                elif not self.alive():
                    break
        finally:
            os.close(self._ready_r)
        if not buf:
            self.proc.wait(5)
            raise ChildStartupError(
                f"the {self.name} process {self.exit_description()} before it was ready; its log is above"
            )
        return _ready_or_raise(self.name, json.loads(buf))

    def stop(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


class ThreadRole(RoleHandle):
    def __init__(self, cfg: ChildConfig) -> None:
        self.name = cfg.role
        self._reports: queue.Queue[dict[str, Any]] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(cfg,), name=f"sgl-{cfg.role}", daemon=True)
        self.thread.start()

    def _run(self, cfg: ChildConfig) -> None:
        try:
            run_role(cfg, self._reports.put)
        except BaseException as e:  # noqa: BLE001 - the thread hands its crash to the parent via self.error
            self.error = e

    def alive(self) -> bool:
        return self.thread.is_alive()

    def exit_description(self) -> str:
        return f"crashed: {self.error!r}" if self.error else "stopped"

    def wait_ready(self) -> dict[str, Any]:
        return _ready_or_raise(self.name, self._reports.get())

    def stop(self, timeout: float) -> None:
        self.thread.join(timeout)


def _ready_or_raise(name: str, status: dict[str, Any]) -> dict[str, Any]:
    if status.get("status") == "ready":
        return status.get("info", {})
    etype = getattr(builtins, status.get("type", ""), None)
    msg = status.get("message", "unknown error")
    if isinstance(etype, type) and issubclass(etype, Exception):
        raise etype(msg)
    raise ChildStartupError(f"the {name} failed to start: {status.get('type')}: {msg}")


def start_roles(cfgs: list[ChildConfig], in_threads: bool) -> tuple[list[RoleHandle], dict[str, dict[str, Any]]]:
    """Start every role, then wait for all; on any failure stop the rest and raise."""
    handles: list[RoleHandle] = []
    try:
        for cfg in cfgs:
            handles.append(ThreadRole(cfg) if in_threads else ProcessRole(cfg))
        infos = {h.name: h.wait_ready() for h in handles}
    except BaseException:
        for h in handles:
            if isinstance(h, ProcessRole) and h.alive():
                h.proc.kill()
            h.stop(5)
        raise
    return handles, infos


class Watchdog(threading.Thread):
    """Polls the roles; the first dead one triggers `on_death(handle)` once."""

    def __init__(self, handles: list[RoleHandle], interval: float, on_death: Callable[[RoleHandle], None]) -> None:
        super().__init__(name="sgl-watchdog", daemon=True)
        self.handles = handles
        self.interval = interval
        self.on_death = on_death
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            for h in self.handles:
                if not h.alive():
                    if not self.stopped.is_set():
                        self.on_death(h)
                    return

    def stop(self) -> None:
        self.stopped.set()


def wait_all(handles: list[RoleHandle], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for h in handles:
        h.stop(max(0.1, deadline - time.monotonic()))
