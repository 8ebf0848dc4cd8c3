"""In-test channel ends for driving a scheduler (or a tokenizer manager) by hand: a
receiver fed from a deque, never blocking, and a sender that keeps what it was sent."""

from __future__ import annotations

from collections import deque

from sgl.core.protocol import Message
from sgl.transports.channel import Receiver, Sender


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
