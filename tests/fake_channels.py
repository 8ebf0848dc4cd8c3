"""In-test channel ends for driving a scheduler (or a tokenizer manager) by hand: a
receiver fed from a deque, never blocking, one awaited from an asyncio queue, and a
sender that keeps what it was sent."""

from __future__ import annotations

import asyncio
from collections import deque

from sgl.core.protocol import Message
from sgl.transports.channel import ChannelClosed, Receiver, Sender


class QueueReceiver(Receiver):
    def __init__(self) -> None:
        self.q: deque[Message] = deque()

    def recv(self, timeout: float | None = None) -> Message | None:
        return self.q.popleft() if self.q else None

    async def recv_async(self) -> Message:
        raise NotImplementedError("a QueueReceiver is polled, never awaited")

    def close(self) -> None:
        pass


class ListSender(Sender):
    def __init__(self) -> None:
        self.msgs: list[Message] = []

    def send(self, msg: Message) -> None:
        self.msgs.append(msg)

    def close(self) -> None:
        pass


class AsyncQueueReceiver(Receiver):
    """A receiver awaited by a tokenizer manager's receive loop; `close` ends it."""

    def __init__(self) -> None:
        self.q: asyncio.Queue[Message | None] = asyncio.Queue()

    def recv(self, timeout: float | None = None) -> Message | None:
        raise NotImplementedError("an AsyncQueueReceiver is awaited, never polled")

    async def recv_async(self) -> Message:
        msg = await self.q.get()
        if msg is None:
            raise ChannelClosed("closed")
        return msg

    def close(self) -> None:
        self.q.put_nowait(None)
