"""`sgl serve`: one process that runs an AsyncEngine and its HTTP server (uvicorn)
on one asyncio loop (uvloop's), until Ctrl-C or SIGTERM, or until a role of the engine dies.

It prints `sgl serve: starting`, then one line per fact a caller may need, the
last being `sgl serve: ready on http://HOST:PORT`; with the tcp transport an
earlier line gives the scheduler's address for `AsyncEngine.connect`.

How each stage ends:
- start-up (`AsyncEngine.start`, which never blocks the loop): a signal cancels
  it; the started children are killed and the socket folder removed. Exit code
  128 + the signal's number.
- serving, on a signal: it stops accepting; open requests get
  GRACEFUL_SHUTDOWN_S to finish, then each one still open ends with an error (a
  stream: an error event, then `data: [DONE]`); the roles shut down and the socket
  files go. Exit code 0: a requested stop is a clean exit. A second Ctrl-C ends
  the open requests at once.
- serving, when a role dies: the watchdog fails every open request (a 503, or an
  error event then `data: [DONE]`), and the server stops as above and exits with
  code 1, so a supervisor restarts it.

It must not exit while a child role is still running or unreaped, and it prints
no traceback for a stop it was asked for."""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import sys
from typing import Any

import msgspec

from sgl.core.server_args import ServerArgs
from sgl.runtime.child import freeze_startup_heap

GRACEFUL_SHUTDOWN_S = 3
BACKSTOP_S = 5  # past the grace, uvicorn cancels what still runs (a client that stopped reading)
WATCH_S = 0.1  # how often the server looks at its engine and at a stop request
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOPPING = "the server is shutting down: the request was cut short"


def _say(line: str, err: bool = False) -> None:
    print(f"sgl serve: {line}", file=sys.stderr if err else sys.stdout, flush=True)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Inherited by every accepted connection: without it a kept-alive connection's response
    # headers and first event wait on the client's delayed ACK (Nagle), about 40 ms added to
    # each request's time to first token after the first (the openai client keeps connections).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


async def _serve(args: ServerArgs) -> int:
    loop = asyncio.get_running_loop()
    caught: list[int] = []
    starting: list[asyncio.Future[Any]] = []

    def interrupt(sig: int) -> None:  # during start-up: cancel it
        caught.append(sig)
        for task in starting:
            task.cancel()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, interrupt, sig)
    _say("starting")
    # Slow imports (uvicorn, the engine) come after the handlers: a signal meanwhile is acted on right after.
    import uvicorn

    from sgl.engine import AsyncEngine
    from sgl.server.app import build_app

    if args.random_seed is None:  # as SGLang: each server samples differently unless a seed is given
        args = msgspec.structs.replace(args, random_seed=random.randint(0, 2**30))
    sock = _listen(args.host, args.port)
    try:
        starting.append(asyncio.ensure_future(AsyncEngine.start(**msgspec.structs.asdict(args))))
        if caught:
            starting[0].cancel()
        engine = await starting[0]
    except asyncio.CancelledError:
        sock.close()
        if not caught:
            raise
        _say(f"stopped during start-up ({signal.Signals(caught[0]).name})")
        return 128 + caught[0]
    except BaseException:
        sock.close()
        raise
    if caught:  # the signal came as the start-up finished
        sock.close()
        await engine.aclose()
        _say(f"stopped during start-up ({signal.Signals(caught[0]).name})")
        return 128 + caught[0]

    # httptools: a streamed chunk's framing in C (h11's is Python, a cost per token at load).
    config = uvicorn.Config(build_app(engine), log_level=args.log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S + BACKSTOP_S, timeout_keep_alive=5,
                            http="httptools")
    server = uvicorn.Server(config)

    def stop(sig: int) -> None:
        # While it serves, uvicorn's own handlers take over (a second Ctrl-C forces its
        # exit); this covers the moments around that, and is not a second signal.
        server.should_exit = True

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    freeze_startup_heap()
    watch = asyncio.ensure_future(_watch(engine, server))
    died: str | None = None
    try:
        host, port = sock.getsockname()[:2]
        if args.transport == "tcp":
            _say(f"scheduler at {engine.roles.addresses.to_scheduler}")
        _say(f"ready on http://{host}:{port}")
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        watch.cancel()
        died = engine.dead_reason()
        await engine.aclose()
    if died is not None:
        _say(f"stopped: {died}", err=True)
        return 1
    _say("stopped")
    return 0


async def _watch(engine: Any, server: Any) -> None:
    """A dead engine stops the server. Once a stop is asked: the grace period, then
    every request still open ends with an error (before uvicorn would cut it)."""
    loop = asyncio.get_running_loop()
    while not server.should_exit:
        reason = engine.dead_reason()
        if reason is not None:
            _say(f"{reason}; exiting", err=True)
            server.should_exit = True
            return
        await asyncio.sleep(WATCH_S)
    deadline = loop.time() + GRACEFUL_SHUTDOWN_S
    while engine.open_requests and not server.force_exit and loop.time() < deadline:
        await asyncio.sleep(WATCH_S / 2)
    if engine.open_requests and engine.dead_reason() is None:
        engine.end_open_requests(STOPPING)


def serve(args: ServerArgs) -> int:
    from sgl.core.log import configure_logging

    configure_logging(args.log_level)  # sgl's own process: the library never configures logging
    try:
        import uvloop

        # sgl's own process runs on uvloop (the library never chooses a caller's loop).
        return uvloop.run(_serve(args))
    except KeyboardInterrupt:  # Ctrl-C before the handlers were in place
        return 130
