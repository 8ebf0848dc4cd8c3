"""The channel interface: a one-directional, typed pipe of protocol messages.

A Sender and a Receiver are made from one address by `open_sender` /
`open_receiver`; the receiving end binds, the sending end connects. Receivers
drop malformed frames (counted, logged) and keep working; a receiver may be given
a policy hook that decides, per message and sender, whether it is let through.
Every queue between two ends is bounded: a blocking sender waits at the bound
(back-pressure between roles), a non-blocking one raises ChannelFull (a caller's
loop must never wait on a send)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import msgspec

from sgl.core.protocol import Message


class Peer(msgspec.Struct, frozen=True):
    """Who sent a message, as the transport knows it: the sender's CURVE public key
    (z85), authenticated by the connection it came on."""

    key: str


# Given to a receiver from above: whether the role may act on a message from this peer.
# None lets it through; a string (the reason) drops it, counted and logged once per peer.
Policy = Callable[[Message, Peer], str | None]


class Sender(ABC):
    @abstractmethod
    def send(self, msg: Message) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class Receiver(ABC):
    @abstractmethod
    def recv(self, timeout: float | None = None) -> Message | None:
        """The next message; None when `timeout` seconds pass first (None: wait forever)."""

    def recv_all_nowait(self) -> list[Message]:
        """Every message already waiting, without blocking."""
        out: list[Message] = []
        while (msg := self.recv(0)) is not None:
            out.append(msg)
        return out

    @abstractmethod
    async def recv_async(self) -> Message:
        """The next message, awaited on the running event loop (no thread hops)."""

    def count_into(self, counts: dict[str, float]) -> None:
        """Count refused frames in `counts` from now on (see refusals.py); a receiver that
        refuses nothing counts nothing."""
        return None

    @abstractmethod
    def close(self) -> None: ...


class ChannelClosed(RuntimeError):
    """The channel was closed while a receiver waited on it."""


class ChannelFull(RuntimeError):
    """A non-blocking sender's queue is at its high-water mark: the receiver is not
    keeping up (or is gone). Nothing was sent."""
