"""`sgl serve`: one process that runs an AsyncEngine and its HTTP server (uvicorn)
on one asyncio loop, until Ctrl-C or SIGTERM.

On start it prints one line per fact a caller may need, the last being
`sgl serve: ready on http://HOST:PORT`; with the tcp transport an earlier line
gives the scheduler's address for `AsyncEngine.connect`. On a signal it stops
accepting, lets open requests end (aborting those still running after a grace
period), shuts the engine's roles down and removes its socket files. It must not
exit while a child role is still running."""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import msgspec

from sgl.core.server_args import ServerArgs

GRACEFUL_SHUTDOWN_S = 3


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


async def _serve(args: ServerArgs) -> None:
    import uvicorn

    from sgl.engine import AsyncEngine
    from sgl.server.app import build_app

    sock = _listen(args.host, args.port)
    # While the roles start, SIGTERM unwinds like Ctrl-C: started children are
    # killed and the socket folder removed on the way out.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        engine = AsyncEngine(**msgspec.structs.asdict(args))
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(engine)
        config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=5)
        server = uvicorn.Server(config)

        # uvicorn swaps in its own handlers while serving and afterwards re-raises the
        # signal it caught against these: they only ask it to stop, never kill us.
        def stop(sig: int, frame: FrameType | None) -> None:
            server.should_exit = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        host, port = sock.getsockname()[:2]
        if args.transport == "tcp":
            print(f"sgl serve: scheduler at {engine.addresses.to_scheduler}", flush=True)
        print(f"sgl serve: ready on http://{host}:{port}", flush=True)
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        await engine.aclose()
    print("sgl serve: stopped", flush=True)


def _exit_on_sigterm(sig: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + sig)


def serve(args: ServerArgs) -> int:
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:  # Ctrl-C before the server was up: the engine cleaned up already
        return 130
    return 0
