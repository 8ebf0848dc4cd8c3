"""ZMQ channels: PUSH/PULL over `ipc://` (one machine) or `tcp://` (across hosts).

The receiver binds and the sender connects. A frame that fails to decode is
counted, logged once per peer, and dropped; the socket keeps working. Async
receive shadows the same socket with zmq.asyncio, so it runs on the caller's
loop without threads.

Over tcp one of three modes holds:
- CURVE (`curve=`): the receiver is a CURVE server that accepts only the peer keys
  it was given (curve.py); every frame is encrypted per connection and arrives
  stamped with its sender's public key, which the receiver hands, with the decoded
  message, to its policy hook (a callable from above: the transport itself has no
  message policy).
- shared key (`key=`): every frame carries an HMAC tag, a session id and a
  sequence number (auth.py); bad tags, replays and reordered frames are dropped.
- neither: loopback addresses only."""

from __future__ import annotations

import asyncio
import math
import time

import zmq
import zmq.asyncio

from sgl.core.log import get_logger
from sgl.core.protocol import Message
from sgl.transports.auth import HEADER_BYTES, AuthError, ReplayGuard, is_loopback, new_session, sign, verify
from sgl.transports.channel import ChannelFull, Peer, Policy, Receiver, Sender
from sgl.transports.codec import MAX_FRAME_BYTES, Codec, DecodeError
from sgl.transports.curve import CurveClient, CurveGate, CurveServer, as_client
from sgl.transports.keys import HOW_TO_MAKE_KEYS
from sgl.transports.refusals import Refusals

log = get_logger("transport")

# Frames a socket queues toward a slow peer, on each end, before a send waits (blocking
# senders) or fails with ChannelFull (non-blocking ones): memory stays bounded.
HWM_FRAMES = 10_000
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
SERVICE_EVERY = 64  # frames a busy CURVE receiver takes between two looks at its authentication requests


class ZmqSender(Sender):
    def __init__(self, address: str, key: bytes | None = None, block: bool = True,
                 curve: CurveClient | None = None) -> None:
        self.address = address
        tcp = address.startswith("tcp://")
        self._key = key if tcp and curve is None else None
        self._session = new_session()
        self._seq = 0
        self._flags = 0 if block else zmq.NOBLOCK
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, HWM_FRAMES)
        self._sock.setsockopt(zmq.LINGER, 1000)  # let a final shutdown message out
        if curve is not None and tcp:
            as_client(self._sock, curve)
        self._sock.connect(address)
        self._codec = Codec()

    def send(self, msg: Message) -> None:
        frame = self._codec.encode(msg)
        if self._key is not None:
            frame = sign(self._key, self._session, self._seq, frame)
            self._seq += 1
        try:
            self._sock.send(frame, flags=self._flags, copy=False)
        except zmq.Again:
            raise ChannelFull(f"{HWM_FRAMES} frames are queued for {self.address}") from None

    def send_raw(self, frame: bytes) -> None:
        """Send bytes as they are (tests of malformed frames)."""
        self._sock.send(frame)

    def close(self) -> None:
        self._sock.close()


class ZmqReceiver(Receiver):
    def __init__(self, address: str, key: bytes | None = None, curve: CurveServer | None = None,
                 policy: Policy | None = None) -> None:
        self.address = address
        tcp = address.startswith("tcp://")
        self._key = key if tcp and curve is None else None
        if tcp and key is None and curve is None and not is_loopback(address):
            raise ValueError(f"refusing to listen on {address} without keys: only loopback addresses may go "
                             f"unauthenticated; {HOW_TO_MAKE_KEYS} (or give a shared transport_key)")
        self.refusals = Refusals(address)
        # A CURVE receiver has a context of its own: ZMQ's authentication hook is one per context.
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context() if tcp and curve is not None else None
        ctx = self._ctx or zmq.Context.instance()
        self._gate = CurveGate(ctx, curve, self._refused) if self._ctx is not None and curve is not None else None
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, HWM_FRAMES)
        # Frames up to twice the limit arrive and are dropped with a log line; larger
        # ones make ZMQ drop the sending peer's connection (it reconnects).
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if self._gate is not None:
                self._gate.guard(self._sock)
            self._sock.bind(address)
        except BaseException:
            self.close()
            raise
        if address.endswith(":0") or address.endswith(":*"):
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.refusals.address = self.address
        self._policy = policy if self._gate is not None else None
        self._replays = ReplayGuard() if self._key is not None else None
        self._frames = tcp and (self._key is not None or self._gate is not None)  # frames with properties
        self._peers: dict[str, Peer] = {}
        self._unserved = 0
        self._async: zmq.asyncio.Socket | None = None
        self._codec = Codec()

    def count_into(self, counts: dict[str, float]) -> None:
        self.refusals.count_into(counts)

    def _refused(self, kind: str, peer: str, event: str, detail: dict[str, object]) -> None:
        self.refusals.refuse(kind, peer, event, **detail)

    @staticmethod
    def _ip(frame: zmq.Frame | bytes) -> str:
        try:
            return str(frame.get("Peer-Address")) if isinstance(frame, zmq.Frame) else "unknown"
        except zmq.ZMQError:
            return "unknown"

    def _accept(self, frame: zmq.Frame | bytes) -> Message | None:
        """The frame's message, or None when it is refused (counted and logged once per peer)."""
        data = frame.buffer if isinstance(frame, zmq.Frame) else frame
        peer = ""
        if self._gate is not None:
            peer = str(frame.get("User-Id")) if isinstance(frame, zmq.Frame) else ""
        if len(data) > MAX_FRAME_BYTES + HEADER_BYTES:
            self.refusals.refuse("malformed", peer or self._ip(frame), "dropped oversized frame",
                                 size=len(data), limit=MAX_FRAME_BYTES)
            return None
        if self._key is not None:
            try:
                session, seq, data = verify(self._key, data)
            except AuthError as e:
                self.refusals.refuse("auth", self._ip(frame), "dropped unauthenticated frame", error=str(e))
                return None
            assert self._replays is not None
            if not self._replays.accept(session, seq):
                self.refusals.refuse("replay", self._ip(frame), "dropped replayed frame", session=session.hex(),
                                     error=f"sequence number {seq} was already seen in this session")
                return None
        try:
            msg = self._codec.decode(data)
        except DecodeError as e:
            self.refusals.refuse("malformed", peer or self._ip(frame), "dropped malformed frame", error=str(e))
            return None
        if self._policy is not None:
            who = self._peers.get(peer)
            if who is None:
                who = self._peers[peer] = Peer(peer)
            reason = self._policy(msg, who)
            if reason is not None:
                self.refusals.refuse("policy", peer, "refused a message", type=type(msg).__name__, reason=reason)
                return None
        return msg

    def _take(self) -> zmq.Frame | bytes | None:
        """The next waiting frame, without blocking. Authentication requests are served
        whenever nothing waits, and every SERVICE_EVERY frames under a steady stream
        (each check costs a few microseconds)."""
        gate = self._gate
        if gate is not None:
            self._unserved += 1
            if self._unserved >= SERVICE_EVERY:
                gate.service()
                self._unserved = 0
        try:
            return self._sock.recv(zmq.NOBLOCK, copy=not self._frames)
        except zmq.Again:
            if gate is not None:
                gate.service()
                self._unserved = 0
            return None

    def recv(self, timeout: float | None = None) -> Message | None:
        poller: zmq.Poller | None = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frame = self._take()
            if frame is not None:
                msg = self._accept(frame)
                if msg is not None:
                    return msg
                continue
            wait_ms = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                # Whole milliseconds, rounded up, and the deadline checked again after a poll that
                # times out: zmq's poll may return up to a millisecond early. Rounded down to 0, a
                # 1 ms wait returned at once, and the scheduler, polling every 1 ms while grammars
                # compile, spun holding the GIL the compile thread needed (80 s for a first compile).
                wait_ms = math.ceil(left * 1000)
            if self._gate is None:
                self._sock.poll(wait_ms)
                continue
            if poller is None:
                poller = zmq.Poller()
                for s in (self._sock, *self._gate.sockets()):
                    poller.register(s, zmq.POLLIN)
            poller.poll(wait_ms)  # authentication requests wake it too

    async def recv_async(self) -> Message:
        while True:
            if self._gate is None:
                if self._async is None:
                    self._async = zmq.asyncio.Socket.from_socket(self._sock)
                msg = self._accept(await self._async.recv(copy=not self._frames))
                if msg is not None:
                    return msg
                continue
            frame = self._take()
            if frame is not None:
                msg = self._accept(frame)
                if msg is not None:
                    return msg
                continue
            await self._readable([self._sock, *self._gate.sockets()])

    @staticmethod
    async def _readable(socks: list[zmq.Socket[bytes]]) -> None:
        """Until one of `socks` may have something to read. Their ZMQ_FDs are registered
        with the loop for this wait only, so nothing stays registered after a close."""
        loop = asyncio.get_running_loop()
        woke: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not woke.done():
                woke.set_result(None)

        fds = [int(s.getsockopt(zmq.FD)) for s in socks]
        for fd in fds:
            loop.add_reader(fd, wake)
        try:
            # ZMQ_FD is edge-triggered: look once more after registering, or a wake-up is lost.
            if not any(int(s.getsockopt(_EVENTS)) & _POLLIN for s in socks):
                await woke
        finally:
            for fd in fds:
                loop.remove_reader(fd)

    def close(self) -> None:
        if self._gate is not None:
            self._gate.close(self._sock)
        self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes whatever of it is still open, so it never waits
