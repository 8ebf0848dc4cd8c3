"""CURVE (CurveZMQ) for the tcp transport: every connection is encrypted and
authenticated with per-connection session keys, so frames can be neither read,
altered nor replayed (a replayed frame fails the nonce check on its connection,
a replayed handshake fails on a new one).

A receiver (it binds) is the CURVE server: it has a key pair and accepts only the
client public keys it was given. Its ZAP handler (ZMQ's authentication hook, a
REP socket in the receiver's own ZMQ context) is served by the receiver itself
whenever it receives or waits, so there is no thread; a monitor socket on the
same context reports failed handshakes and failed decryption (libzmq drops the
connection). ZMQ stamps every frame from an authenticated connection with the
sender's public key (the frame's "User-Id").

It knows keys and sockets only, never what a message means."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from sgl.transports.keys import KeyPair

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"sgl"
# Protocol failures only: garbage, a replayed or forged handshake, a frame that fails decryption
# or repeats a nonce. A handshake cut short (a peer that closed, or one left waiting past the
# handshake timeout while its receiver was not reading) drops the connection but is no attack.
# Known libzmq 4.3 quirk: with this event monitored, a frame that fails inside an established
# connection (only a man in the middle can inject one) makes libzmq stop reading that connection
# instead of closing it (sending the event resets errno); its client stalls until it reconnects.
# Not monitoring would leave such failures uncounted; a failed handshake closes either way.
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enums cost microseconds a use


class CurveServer(msgspec.Struct, frozen=True):
    """A receiving end: its key pair and the public keys of the peers it accepts."""

    keys: KeyPair
    allowed: tuple[str, ...]


class CurveClient(msgspec.Struct, frozen=True):
    """A sending end: its key pair and the public key of the receiver it connects to."""

    keys: KeyPair
    server_public: str


def as_client(sock: zmq.Socket[bytes], c: CurveClient) -> None:
    sock.curve_publickey = c.keys.public.encode("ascii")
    sock.curve_secretkey = c.keys.secret.encode("ascii")
    sock.curve_serverkey = c.server_public.encode("ascii")


# (kind, peer, event, detail) -> None: how a refused handshake is reported.
OnRefuse = Callable[[str, str, str, dict[str, object]], None]


class CurveGate:
    """The ZAP handler and handshake monitor of one CURVE server socket, in the
    socket's private context. `service()` answers every waiting authentication
    request and reads every waiting event without blocking."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], server: CurveServer, on_refuse: OnRefuse) -> None:
        self.allowed = frozenset(z85.decode(k) for k in server.allowed)
        self.on_refuse = on_refuse
        self.zap: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)  # before any CURVE socket of this context binds: none is ever unguarded
        self.monitor: zmq.Socket[bytes] | None = None
        self._server = server

    def guard(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` a CURVE server under this gate (call before it binds)."""
        sock.curve_server = True
        sock.curve_publickey = self._server.keys.public.encode("ascii")
        sock.curve_secretkey = self._server.keys.secret.encode("ascii")
        sock.zap_domain = ZAP_DOMAIN
        self.monitor = sock.get_monitor_socket(_FAILED)

    def sockets(self) -> list[zmq.Socket[bytes]]:
        return [self.zap] + ([self.monitor] if self.monitor is not None else [])

    def service(self) -> None:
        while int(self.zap.getsockopt(_EVENTS)) & _POLLIN:
            self._answer(self.zap.recv_multipart())
        mon = self.monitor
        while mon is not None and int(mon.getsockopt(_EVENTS)) & _POLLIN:
            ev = parse_monitor_message(mon.recv_multipart())
            # libzmq has dropped the connection; the event names no peer.
            self.on_refuse("auth", "unknown", "dropped a connection that failed CURVE authentication",
                           {"zmq_event": int(ev["event"]), "zmq_error": hex(int(ev["value"]))})

    def _answer(self, msg: list[bytes]) -> None:
        """One ZAP request (RFC 27): version, request id, domain, address, identity,
        mechanism, credentials. The reply's user id is the client's z85 public key."""
        if len(msg) < 2:
            return
        request_id = msg[1]
        if len(msg) != 7 or msg[0] != b"1.0" or msg[5] != b"CURVE":
            self.zap.send_multipart([b"1.0", request_id, b"400", b"CURVE only", b"", b""])
            self.on_refuse("auth", "unknown", "refused a connection that did not use CURVE", {})
            return
        address, key = msg[3].decode("ascii", "replace"), msg[6]
        if key in self.allowed:
            self.zap.send_multipart([b"1.0", request_id, b"200", b"OK", z85.encode(key), b""])
            return
        self.zap.send_multipart([b"1.0", request_id, b"400", b"key not allowed", b"", b""])
        peer = z85.encode(key).decode("ascii") if len(key) == 32 else address
        self.on_refuse("auth", peer, "refused a client key that is not allowed", {"ip": address})

    def close(self, sock: zmq.Socket[bytes]) -> None:
        if self.monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
        self.zap.close(linger=0)
