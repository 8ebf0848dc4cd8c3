"""A real `sgl serve` process on 127.0.0.1 for tests: started with
`python -m sgl.launch_server --port 0`, ready once it prints its address, stopped
with a signal; plus small helpers to wait on its state without sleeping blind, and the
HTTP clients the serve tests talk to it with (`HTTP`, `openai_client`)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.conftest import assert_kv_balanced

START_TIMEOUT_S = 120

# Every httpx client builds a TLS context unless given one, loading the CA bundle: ~50 ms
# on the CI machine, paid by each `httpx.get`/`httpx.post` (a client apiece) and each
# openai client. The servers here are plain http on loopback, so one context serves all.
SSL_CONTEXT = httpx.create_ssl_context()
# `httpx.get(...)` and friends, without a client built per call: the same defaults (5 s
# timeout, no headers) and, with keep-alive off, a fresh connection per request as they
# make. Tests pass their own headers and timeouts per call.
HTTP = httpx.Client(verify=SSL_CONTEXT, limits=httpx.Limits(max_keepalive_connections=0))


def openai_client(base_url: str, api_key: str, **kw: Any) -> openai.OpenAI:
    """`openai.OpenAI(base_url=..., api_key=..., **kw)` with openai's own default http
    client (its limits, keep-alive, redirects), built on the shared TLS context."""
    return openai.OpenAI(base_url=base_url, api_key=api_key,
                         http_client=openai.DefaultHttpxClient(verify=SSL_CONTEXT), **kw)


class ServerProc:
    """`wait=False` returns as soon as the process is started (see `wait_output`);
    `env` is added to the environment (e.g. TMPDIR, to see its socket folder)."""

    def __init__(self, *flags: str, api_key: str | None = None, stderr_path: str | None = None,
                 wait: bool = True, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "sgl.launch_server", "--host", "127.0.0.1", "--port", "0", *flags]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self.api_key = api_key
        self._stderr = open(stderr_path, "wb") if stderr_path else None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env={**os.environ, **(env or {})})
        self.output = ""  # stdout read so far
        self.scheduler_address: str | None = None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = ""
        if wait:
            self.url = self._wait_ready()

    def wait_output(self, text: str, timeout: float = START_TIMEOUT_S) -> bool:
        """Read stdout until it holds a whole line containing `text`; False if the
        process ends or the time runs out first."""
        return self._read_until(lambda out: text in out and "\n" in out[out.index(text):], timeout)

    def _read_until(self, done: Callable[[str], bool], timeout: float) -> bool:
        """Read stdout (raw, unbuffered: select sees exactly what is unread) until `done(output)`."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while not done(self.output) and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], min(0.5, max(0.0, deadline - time.monotonic())))
            if not ready:
                if self.proc.poll() is not None:
                    return False
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return False
            self.output += chunk.decode()
        return done(self.output)

    def _wait_ready(self) -> str:
        if self.wait_output("ready on "):
            for line in self.output.splitlines():
                if "scheduler at " in line:
                    self.scheduler_address = line.rsplit(" ", 1)[1].strip()
                if "ready on " in line:
                    return line.rsplit(" ", 1)[1].strip()
        self.proc.kill()
        raise RuntimeError(f"sgl serve did not start (exit {self.proc.poll()})")

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return HTTP.get(self.url + path, headers=self.headers, timeout=30, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return HTTP.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, timeout=30, **kw)

    def info(self) -> dict[str, Any]:
        r = self.get("/get_server_info")
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """The server info once nothing runs or waits (aborts travel asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if (info["running"] == 0 and info["waiting"] == 0) or time.monotonic() > deadline:
                return info
            time.sleep(0.05)

    def assert_balanced(self) -> None:
        assert_kv_balanced(self.wait_idle())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            if self._stderr is not None:
                self._stderr.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`, zombies included."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def exists(pid: int) -> bool:
    """Alive or a zombie (not yet reaped)."""
    return os.path.exists(f"/proc/{pid}")


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
