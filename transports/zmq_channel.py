"""ZMQ channels: PUSH/PULL over `ipc://` (one machine) or `tcp://` (across hosts).

The receiver binds and the sender connects. A frame that fails to decode is
logged and dropped; the socket keeps working. Async receive shadows the same
socket with zmq.asyncio, so it runs on the caller's loop without threads.

Over tcp every frame is signed with the engine's shared key (HMAC-SHA256, see
auth.py) and a receiver drops frames that fail the check; a tcp receiver without
a key refuses any address but loopback."""

from __future__ import annotations

import structlog
import zmq
import zmq.asyncio

from sgl.core.protocol import Message
from sgl.transports.auth import TAG_BYTES, AuthError, is_loopback, sign, verify
from sgl.transports.channel import ChannelFull, Receiver, Sender
from sgl.transports.codec import MAX_FRAME_BYTES, Codec, DecodeError

log = structlog.get_logger("sgl.transport")

# Frames a socket queues toward a slow peer, on each end, before a send waits (blocking
# senders) or fails with ChannelFull (non-blocking ones): memory stays bounded.
HWM_FRAMES = 10_000


class ZmqSender(Sender):
    def __init__(self, address: str, key: bytes | None = None, block: bool = True) -> None:
        self.address = address
        self._key = key if address.startswith("tcp://") else None
        self._flags = 0 if block else zmq.NOBLOCK
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, HWM_FRAMES)
        self._sock.setsockopt(zmq.LINGER, 1000)  # let a final shutdown message out
        self._sock.connect(address)
        self._codec = Codec()

    def send(self, msg: Message) -> None:
        frame = self._codec.encode(msg)
        try:
            self._sock.send(frame if self._key is None else sign(self._key, frame), flags=self._flags, copy=False)
        except zmq.Again:
            raise ChannelFull(f"{HWM_FRAMES} frames are queued for {self.address}") from None

    def send_raw(self, frame: bytes) -> None:
        """Send bytes as they are (tests of malformed frames)."""
        self._sock.send(frame)

    def close(self) -> None:
        self._sock.close()


class ZmqReceiver(Receiver):
    def __init__(self, address: str, key: bytes | None = None) -> None:
        self.address = address
        self._key = key if address.startswith("tcp://") else None
        if address.startswith("tcp://") and key is None and not is_loopback(address):
            raise ValueError(f"refusing to listen on {address} without a transport_key: "
                             "only loopback addresses may go unauthenticated")
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, HWM_FRAMES)
        # Frames up to twice the limit arrive and are dropped with a log line; larger
        # ones make ZMQ drop the sending peer's connection (it reconnects).
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        if address.endswith(":0") or address.endswith(":*"):
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._async: zmq.asyncio.Socket | None = None
        self._codec = Codec()

    def _decode(self, frame: bytes) -> Message | None:
        if len(frame) > MAX_FRAME_BYTES + TAG_BYTES:
            log.warning("dropped oversized frame", address=self.address, size=len(frame), limit=MAX_FRAME_BYTES)
            return None
        try:
            return self._codec.decode(frame if self._key is None else verify(self._key, frame))
        except AuthError as e:
            log.warning("dropped unauthenticated frame", address=self.address, error=str(e))
            return None
        except DecodeError as e:
            log.warning("dropped malformed frame", address=self.address, error=str(e))
            return None

    def recv(self, timeout: float | None = None) -> Message | None:
        while True:
            if timeout is not None and not self._sock.poll(int(timeout * 1000)):
                return None
            msg = self._decode(self._sock.recv())
            if msg is not None:
                return msg
            if timeout == 0:
                return None

    async def recv_async(self) -> Message:
        if self._async is None:
            self._async = zmq.asyncio.Socket.from_socket(self._sock)
        while True:
            msg = self._decode(await self._async.recv())
            if msg is not None:
                return msg

    def close(self) -> None:
        self._sock.close()
