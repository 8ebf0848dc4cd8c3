"""In-process channels: all roles in one process, the scheduler on a thread.

Messages still go through the codec, so tests over inproc exercise the wire
format. Async receivers are woken with call_soon_threadsafe; no helper thread."""

from __future__ import annotations

import asyncio
import collections
import threading

from sgl.core.log import get_logger
from sgl.core.protocol import Message
from sgl.transports.channel import ChannelClosed, Receiver, Sender
from sgl.transports.codec import Codec, DecodeError

log = get_logger("transport")


class _Pipe:
    def __init__(self) -> None:
        self.frames: collections.deque[bytes] = collections.deque()
        self.cond = threading.Condition()
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.closed = False

    def put(self, frame: bytes) -> None:
        with self.cond:
            if self.closed:
                return
            self.frames.append(frame)
            self.cond.notify()
            waiters, self.waiters = self.waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_pipes: dict[str, _Pipe] = {}
_pipes_lock = threading.Lock()


def _pipe(address: str) -> _Pipe:
    with _pipes_lock:
        return _pipes.setdefault(address, _Pipe())


class InprocSender(Sender):
    def __init__(self, address: str) -> None:
        self._pipe = _pipe(address)
        self._codec = Codec()

    def send(self, msg: Message) -> None:
        self._pipe.put(self._codec.encode(msg))

    def send_raw(self, frame: bytes) -> None:
        """Send bytes as they are (tests of malformed frames)."""
        self._pipe.put(frame)

    def close(self) -> None:
        pass


class InprocReceiver(Receiver):
    def __init__(self, address: str) -> None:
        self._address = address
        self._pipe = _pipe(address)
        self._codec = Codec()

    def _pop(self) -> Message | None:
        """Decode the next good frame; caller holds the condition."""
        while self._pipe.frames:
            frame = self._pipe.frames.popleft()
            try:
                return self._codec.decode(frame)
            except DecodeError as e:
                log.warning("dropped malformed frame", address=self._address, error=str(e))
        return None

    def recv(self, timeout: float | None = None) -> Message | None:
        p = self._pipe
        with p.cond:
            while True:
                if p.closed:
                    raise ChannelClosed(self._address)
                msg = self._pop()
                if msg is not None or timeout == 0:
                    return msg
                if not p.cond.wait(timeout):
                    return self._pop()

    async def recv_async(self) -> Message:
        loop = asyncio.get_running_loop()
        p = self._pipe
        while True:
            with p.cond:
                if p.closed:
                    raise ChannelClosed(self._address)
                msg = self._pop()
                if msg is not None:
                    return msg
                fut: asyncio.Future[None] = loop.create_future()
                p.waiters.append((loop, fut))
            await fut

    def close(self) -> None:
        p = self._pipe
        with p.cond:
            p.closed = True
            p.cond.notify_all()
            waiters, p.waiters = p.waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)
        with _pipes_lock:
            if _pipes.get(self._address) is p:
                del _pipes[self._address]
