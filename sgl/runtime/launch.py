"""One child role's handle, from its start to its exit, and the watchdog over them.

Processes are fresh interpreters (`python -m sgl.runtime.child`), never forks: the
caller's main module is not re-imported, so no `__main__` guard is needed, and a
CUDA-initialised caller is safe. Under the inproc transport the roles run on
daemon threads instead. Either way a handle gives the role's readiness report when
polled (`poll_ready`, never blocking: the engine asks all its roles in turn), and
re-raises its startup error; afterwards a watchdog turns a dead role into one
callback, never a hang.
An engine starts and stops its roles together through sgl/runtime/engine_roles.py;
`off_loop` runs its blocking start and stop work off the caller's loop. Nothing
here installs a signal handler."""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import queue
import select
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from sgl.core.protocol import ShutdownReq
from sgl.runtime.roles import ChildConfig, run_role
from sgl.transports.factory import open_sender

T = TypeVar("T")


class ChildStartupError(RuntimeError):
    """A role failed to start and its error type is not a built-in exception."""


class RoleHandle(ABC):
    name: str

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def poll_ready(self) -> dict[str, Any] | None:
        """Without blocking: the role's info once it reported ready, None while it
        starts; raises its startup error."""

    @abstractmethod
    def kill(self) -> None:
        """Force the role to stop now and reap it (a thread cannot be forced: it is asked to stop)."""

    @abstractmethod
    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` for a clean exit, then force it."""

    def exit_description(self) -> str:
        return "stopped"


class ProcessRole(RoleHandle):
    def __init__(self, cfg: ChildConfig) -> None:
        self.name = cfg.name
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sgl.runtime.child", str(w)],
            stdin=subprocess.PIPE,
            pass_fds=(w,),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        os.close(w)
        self._ready_r: int | None = r
        self._buf = b""
        self._report: dict[str, Any] | None = None
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

    def _read_report(self) -> dict[str, Any] | None:
        """Read what the readiness pipe holds now; the report once it is complete (the
        pipe is closed then), else None."""
        if self._report is not None:
            return self._report
        if self._ready_r is None:
            raise ChildStartupError(f"the {self.name} already reported")
        ready, _, _ = select.select([self._ready_r], [], [], 0)
        if ready:
            chunk = os.read(self._ready_r, 65536)
            self._buf += chunk
            if chunk and not self._buf.endswith(b"\n"):
                return None
        elif self.alive():
            return None
        os.close(self._ready_r)
        self._ready_r = None
        if not self._buf:  # end of file, or the process is gone, without a report
            self.proc.wait(5)
            raise ChildStartupError(
                f"the {self.name} process {self.exit_description()} before it was ready; its log is above"
            )
        self._report = json.loads(self._buf)
        return self._report

    def poll_ready(self) -> dict[str, Any] | None:
        report = self._read_report()
        return None if report is None else _ready_or_raise(self.name, report)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            pass

    def stop(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._ready_r is not None:  # it never reported
            os.close(self._ready_r)
            self._ready_r = None
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


class ThreadRole(RoleHandle):
    def __init__(self, cfg: ChildConfig) -> None:
        self.name = cfg.name
        self.inbox = cfg.addresses.to_scheduler if cfg.role == "scheduler" else cfg.addresses.to_detokenizer
        self._reports: queue.Queue[dict[str, Any]] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(cfg,), name=f"sgl-{cfg.role}", daemon=True)
        self.thread.start()

    def _run(self, cfg: ChildConfig) -> None:
        try:
            run_role(cfg, self._reports.put, in_thread=True)
        except BaseException as e:  # noqa: BLE001 - the thread hands its crash to the parent via self.error
            self.error = e

    def alive(self) -> bool:
        return self.thread.is_alive()

    def exit_description(self) -> str:
        return f"crashed: {self.error!r}" if self.error else "stopped"

    def poll_ready(self) -> dict[str, Any] | None:
        try:
            report = self._reports.get_nowait()
        except queue.Empty:
            if self.alive():
                return None
            try:  # it may have reported just before it ended
                report = self._reports.get_nowait()
            except queue.Empty:
                raise ChildStartupError(
                    f"the {self.name} thread {self.exit_description()} before it was ready") from None
        self._reports.put(report)  # poll_ready may be asked again
        return _ready_or_raise(self.name, report)

    def kill(self) -> None:
        """A ShutdownReq on the role's own channel: it stops at its next read (once started, if
        it is starting). Without it, a role whose peer died would wait on its input for good."""
        if self.alive():
            open_sender(self.inbox).send(ShutdownReq())

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


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a daemon thread. Unlike asyncio.to_thread (the loop's default
    executor, which asyncio.run joins at exit), a caller cancelled meanwhile does
    not wait for it: the thread is abandoned, its result dropped."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="sgl-start", daemon=True).start()
    return await fut


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

    def stop(self, timeout: float = 2.0) -> None:
        """Stop and join it (it wakes at once), unless called from its own callback."""
        self.stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
