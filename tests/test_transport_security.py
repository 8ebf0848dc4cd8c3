"""The tcp transport's security, over real sockets on loopback: CURVE keys from
`sgl keys new`, a real `sgl serve --transport-keys DIR` on the null model, and
clients attached with `AsyncEngine.connect(keys=..., server_key=...)`.

Shown here: a client without an allowed key gets nothing through; nothing a
client sends crosses the wire in plaintext; a recorded connection replayed on a
new connection, and a frame repeated inside its own connection, have no effect;
client A cannot abort, read, detach or attach as client B; a non-admin client can
neither shut the server down nor flush its cache (an admin can); wrong, truncated
and garbage frames are dropped, counted (`transport_refused*` in get_server_info)
and logged once per peer, and the server keeps serving with its KV balanced. The
last test, an admin key shuts the server down. (The channels themselves, CURVE and
the shared-key mode's sequence numbers, are tested in tests/test_transports.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

import sgl
from sgl.cli import main as cli_main
from sgl.core.protocol import (
    AbortReq,
    AttachReq,
    DetachReq,
    FlushCacheReq,
    GenerateReqInput,
    HealthCheckReq,
    ShutdownReq,
)
from sgl.core.sampling_params import SamplingParams
from sgl.runtime.identity import client_id_of
from sgl.transports.keys import load_key_dir, load_pair, load_public, new_pair
from tests.serve_util import ServerProc

API_KEY = "sk-security"
CLIENTS = ("alice", "bob", "carol")


@pytest.fixture(scope="module")
def keydir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    assert cli_main(["keys", "new", str(d)]) == 0
    for flags in (*(["--name", n] for n in CLIENTS), ["--name", "root", "--admin"]):
        assert cli_main(["keys", "new", str(d), *flags]) == 0
    assert cli_main(["keys", "new", str(d / "elsewhere"), "--name", "mallory"]) == 0  # never allowed
    return d


@pytest.fixture(scope="module")
def server(keydir: Path, null_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("security") / "server.log"
    s = ServerProc("--model-path", null_model_dir, "--load-format", "null", "--skip-tokenizer-init",
                   "--transport", "tcp", "--transport-keys", str(keydir), "--max-total-tokens", "4000",
                   "--disable-radix-cache", "--log-level", "warning", api_key=API_KEY, stderr_path=str(log))
    s.log_path = log  # type: ignore[attr-defined]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    yield (lp := asyncio.new_event_loop())
    lp.close()


def _connect(loop: asyncio.AbstractEventLoop, address: str, keydir: Path, name: str,
             folder: Path | None = None, timeout: float = 10.0, heartbeat: float = 1.0) -> sgl.AsyncEngine:
    key = (folder or keydir) / f"{name}.key_secret"
    return loop.run_until_complete(sgl.AsyncEngine.connect(
        address, keys=str(key), server_key=str(keydir / "server.key"), skip_tokenizer_init=True, timeout=timeout,
        heartbeat_interval=heartbeat))


@pytest.fixture(scope="module")
def clients(server: ServerProc, keydir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[dict[str, sgl.AsyncEngine]]:
    assert server.scheduler_address is not None
    out = {name: _connect(loop, server.scheduler_address, keydir, name) for name in (*CLIENTS, "root")}
    yield out
    for e in out.values():
        loop.run_until_complete(e.aclose())


def _wait_count(server: ServerProc, name: str, above: float, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (info := server.info())[name] <= above and time.monotonic() < deadline:
        time.sleep(0.05)
    assert info[name] > above, f"{name} stayed at {info[name]}"
    return info


def _check_serving(server: ServerProc) -> None:
    # ignore_eos: the null model's random draw may be the end-of-sequence token
    r = server.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
    server.assert_balanced()


def _gen(engine: sgl.AsyncEngine, loop: asyncio.AbstractEventLoop, ids: list[int], n: int = 3,
         **kw: Any) -> dict[str, Any]:
    out = loop.run_until_complete(asyncio.wait_for(engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": n, "ignore_eos": True}, **kw), 30))
    assert isinstance(out, dict)
    return out


class Proxy:
    """A TCP forwarder in front of the scheduler: records what clients send, and can
    repeat the next encrypted message frame (ZMTP framing after the 64-byte greeting)
    inside its own connection."""

    def __init__(self, target: str) -> None:
        self.target = target.removeprefix("tcp://").rsplit(":", 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.streams: list[bytearray] = []
        self.repeat_next = threading.Event()
        self.repeated = threading.Event()
        self._socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:  # closed
                return
            u = socket.create_connection((self.target[0], int(self.target[1])))
            self._socks += [c, u]
            self.streams.append(rec := bytearray())
            threading.Thread(target=self._pipe, args=(u, c), daemon=True).start()
            threading.Thread(target=self._forward, args=(c, u, rec), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while d := a.recv(65536):
                b.sendall(d)
        _hang_up(a, b)

    def _forward(self, c: socket.socket, u: socket.socket, rec: bytearray) -> None:
        buf, greeted = b"", 0
        with contextlib.suppress(OSError):
            while d := c.recv(65536):
                rec += d
                buf, out = buf + d, b""
                if greeted < 64:
                    k = min(64 - greeted, len(buf))
                    out, buf, greeted = buf[:k], buf[k:], greeted + k
                while greeted == 64 and len(buf) >= 2:
                    head = 9 if buf[0] & 2 else 2
                    if len(buf) < head:
                        break
                    size = int.from_bytes(buf[1:9], "big") if head == 9 else buf[1]
                    if len(buf) < head + size:
                        break
                    frame, buf = buf[: head + size], buf[head + size:]
                    out += frame
                    if frame[head:head + 8] == b"\x07MESSAGE" and self.repeat_next.is_set():
                        self.repeat_next.clear()
                        out += frame  # the same encrypted frame again, same connection
                        self.repeated.set()
                u.sendall(out)
        _hang_up(c, u)

    def close(self) -> None:
        _hang_up(*self._socks)


def _hang_up(*socks: socket.socket) -> None:
    """Shut down, then close: a close alone leaves a socket another thread reads from open."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


# ---- keys, without a server ---------------------------------------------------


def test_keys_cli_writes_pairs_and_allows_clients(keydir: Path) -> None:
    keys = load_key_dir(keydir)
    assert len(keys.clients) == len(CLIENTS) and len(keys.admins) == 1
    assert (keydir / "server.key_secret").stat().st_mode & 0o077 == 0
    assert load_public(keydir / "allowed" / "alice.key") == load_pair(keydir / "alice.key_secret").public
    mallory = load_pair(keydir / "elsewhere" / "mallory.key_secret").public
    assert mallory not in keys.allowed()
    assert cli_main(["keys", "new", str(keydir), "--name", "alice"]) == 2  # never overwrites a pair


# ---- against a real server -------------------------------------------------------


def test_a_client_without_an_allowed_key_gets_nothing_through(
        server: ServerProc, keydir: Path, loop: asyncio.AbstractEventLoop) -> None:
    assert server.scheduler_address is not None
    before = server.info()
    with pytest.raises(ConnectionError):
        _connect(loop, server.scheduler_address, keydir, "mallory", folder=keydir / "elsewhere", timeout=2.0)
    info = _wait_count(server, "transport_refused_auth", before["transport_refused_auth"])
    assert info["transport_refused_policy"] == before["transport_refused_policy"]  # nothing got as far
    assert info["prefill_tokens"] == before["prefill_tokens"]
    _check_serving(server)


def test_the_wire_is_encrypted_and_replays_have_no_effect(
        server: ServerProc, keydir: Path, loop: asyncio.AbstractEventLoop) -> None:
    assert server.scheduler_address is not None
    proxy = Proxy(server.scheduler_address)
    # No health checks: the only frames on the wire are the test's (frames sent right after a
    # repeated one share its fate when the server drops that connection).
    carol = _connect(loop, proxy.address, keydir, "carol", heartbeat=3600)
    try:
        prompt = [101, 202, 303, 404, 505, 606, 707]
        before = server.wait_idle()
        out = _gen(carol, loop, prompt, rid="secret-rid-4711")
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        sent = b"".join(bytes(s) for s in proxy.streams)
        assert b"secret-rid-4711" not in sent and b"generate" not in sent and len(sent) > 200
        assert server.wait_idle()["prefill_tokens"] - before["prefill_tokens"] == len(prompt)

        # The whole recorded connection, replayed on a new one: the handshake fails.
        before = server.info()
        raw = socket.create_connection(("127.0.0.1", int(server.scheduler_address.rsplit(":", 1)[1])))
        raw.sendall(bytes(proxy.streams[0]))
        info = _wait_count(server, "transport_refused_auth", before["transport_refused_auth"])
        raw.close()

        # One encrypted frame repeated inside its own connection: its nonce was used, so it is
        # refused and the request runs once. (libzmq then stops reading that connection rather
        # than closing it, see transports/curve.py: this client is done.)
        proxy.repeat_next.set()
        out = _gen(carol, loop, prompt, rid="twice")
        assert proxy.repeated.wait(5) and out["meta_info"]["finish_reason"]["type"] == "length"
        _wait_count(server, "transport_refused_auth", info["transport_refused_auth"])
        assert server.wait_idle()["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    finally:
        loop.run_until_complete(carol.aclose())
        proxy.close()
    _check_serving(server)


def test_client_a_cannot_abort_read_detach_or_attach_as_client_b(
        server: ServerProc, keydir: Path, clients: dict[str, sgl.AsyncEngine],
        loop: asyncio.AbstractEventLoop) -> None:
    alice, bob = clients["alice"], clients["bob"]
    b_id = bob.tm.client_id
    assert b_id == client_id_of(load_pair(keydir / "bob.key_secret").public)  # bound to the key: not chosen
    before = server.info()["transport_refused_policy"]

    async def bob_runs_while_alice_meddles() -> dict[str, Any]:
        last: dict[str, Any] = {}
        meddled = False
        async for chunk in bob.stream(input_ids=[7, 8, 9], sampling_params={"max_new_tokens": 400, "ignore_eos": True},
                                      rid="long"):
            if not meddled:
                meddled = True
                alice.tm.send.send(AbortReq(f"{b_id}:long"))
                alice.tm.send.send(AttachReq(b_id, alice.tm.recv.address))  # type: ignore[attr-defined]
                alice.tm.send.send(DetachReq(b_id))
                alice.tm.send.send(GenerateReqInput(f"{b_id}:forged", [1], SamplingParams(max_new_tokens=1)))
                alice.tm.send.send(HealthCheckReq(origin=b_id))
            last = chunk
        return last

    last = loop.run_until_complete(asyncio.wait_for(bob_runs_while_alice_meddles(), 60))
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert last["meta_info"]["completion_tokens"] == 400
    _wait_count(server, "transport_refused_policy", before + 4)
    # Bob is still attached as himself and reads his own outputs.
    assert _gen(bob, loop, [1, 2], n=2)["meta_info"]["finish_reason"]["type"] == "length"
    _check_serving(server)


def test_a_second_attach_of_the_same_key_replaces_the_first(
        server: ServerProc, keydir: Path, loop: asyncio.AbstractEventLoop) -> None:
    assert server.scheduler_address is not None
    first = _connect(loop, server.scheduler_address, keydir, "carol")
    second = _connect(loop, server.scheduler_address, keydir, "carol")
    try:
        assert first.tm.client_id == second.tm.client_id
        assert _gen(second, loop, [4, 4])["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        for e in (second, first):
            loop.run_until_complete(e.aclose())
    _check_serving(server)


def test_only_an_admin_key_flushes_the_cache(
        server: ServerProc, clients: dict[str, sgl.AsyncEngine], loop: asyncio.AbstractEventLoop) -> None:
    alice, root = clients["alice"], clients["root"]
    before = server.info()["transport_refused_policy"]
    alice.tm.send.send(ShutdownReq())
    alice.tm.send.send(FlushCacheReq(origin=alice.tm.client_id))
    _wait_count(server, "transport_refused_policy", before + 1)
    assert server.get("/health").status_code == 200
    assert _gen(alice, loop, [1])["meta_info"]["finish_reason"]["type"] == "length"
    out = loop.run_until_complete(asyncio.wait_for(root.flush_cache(), 10))
    assert out["success"], out
    _check_serving(server)


def _push(server: ServerProc, keydir: Path | None = None, name: str = "", server_public: str = "") -> zmq.Socket[bytes]:
    """A raw PUSH at the scheduler: under CURVE with a client's key, or plain without `keydir`."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    if keydir is not None:
        pair = load_pair(keydir / f"{name}.key_secret")
        sock.curve_publickey, sock.curve_secretkey = pair.public.encode(), pair.secret.encode()
        sock.curve_serverkey = (server_public or load_public(keydir / "server.key")).encode()
    assert server.scheduler_address is not None
    sock.connect(server.scheduler_address)
    return sock


def _raw_tcp(server: ServerProc, data: bytes) -> None:
    assert server.scheduler_address is not None
    s = socket.create_connection(("127.0.0.1", int(server.scheduler_address.rsplit(":", 1)[1])))
    s.sendall(data)
    time.sleep(0.2)
    s.close()


BAD: dict[str, tuple[str, Callable[[ServerProc, Path], None]]] = {
    "garbage-bytes": ("transport_refused_auth", lambda s, k: _raw_tcp(s, b"\xff" + b"\x00" * 8 + b"\x7f" + b"x" * 200)),
    # Counted only when the server notices the mechanism mismatch before the client hangs up (a race).
    "not-curve": ("", lambda s, k: _send_close(_push(s), b"\x81\xa4type\xa5abort")),
    "wrong-server-key": ("transport_refused_auth",
                         lambda s, k: _send_close(_push(s, k, "alice", new_pair().public), b"x")),
    "garbage-in-curve": ("transport_refused_malformed", lambda s, k: _send_close(_push(s, k, "carol"),
                                                                                  b"\xc1\xc1 not msgpack")),
    "unknown-tag-in-curve": ("transport_refused_malformed", lambda s, k: _send_close(
        _push(s, k, "carol"), msgspec.msgpack.encode({"type": "nope"}))),
    "out-of-vocab-in-curve": ("", lambda s, k: _send_close(_push(s, k, "carol"), msgspec.msgpack.encode(
        GenerateReqInput(f"{client_id_of(load_pair(k / 'carol.key_secret').public)}:oov", [10**7],
                         SamplingParams(max_new_tokens=2))))),
}


def _send_close(sock: zmq.Socket[bytes], frame: bytes) -> None:
    sock.send(frame)
    time.sleep(0.3)
    sock.close(linger=500)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_frames_are_dropped_and_the_server_keeps_serving(name: str, server: ServerProc, keydir: Path) -> None:
    counter, send = BAD[name]
    before = server.info()
    send(server, keydir)
    if counter:
        _wait_count(server, counter, before[counter])
    _check_serving(server)


def test_a_truncated_handshake_is_dropped(server: ServerProc, keydir: Path, loop: asyncio.AbstractEventLoop) -> None:
    assert server.scheduler_address is not None
    proxy = Proxy(server.scheduler_address)
    e = _connect(loop, proxy.address, keydir, "bob")
    loop.run_until_complete(e.aclose())
    proxy.close()
    _raw_tcp(server, bytes(proxy.streams[0])[:100])  # greeting and half a HELLO
    _check_serving(server)


def test_refusals_are_logged_once_per_peer(server: ServerProc, keydir: Path) -> None:
    carol = load_pair(keydir / "carol.key_secret").public
    before = server.info()["transport_refused_malformed"]
    sock = _push(server, keydir, "carol")
    for _ in range(5):
        sock.send(b"\xc1 still not msgpack")
    time.sleep(0.3)
    sock.close(linger=500)
    _wait_count(server, "transport_refused_malformed", before + 4)
    log = Path(server.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
    lines = [ln for ln in log.splitlines() if "dropped malformed frame" in ln and carol in ln]
    assert len(lines) == 1, lines
    _check_serving(server)


def test_last_an_admin_key_shuts_the_server_down(server: ServerProc, clients: dict[str, sgl.AsyncEngine]) -> None:
    """Last in the file: the module's server stops here."""
    clients["root"].tm.send.send(ShutdownReq())
    assert server.proc.wait(30) is not None  # sgl serve exits once its scheduler is gone
