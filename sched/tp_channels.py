"""The scheduler's channels under tensor parallelism: every rank sees rank 0's input.

Each rank runs the same scheduler loop over its shard of the model. Only rank 0 is
connected to the tokenizer manager and the detokenizer; each of its reads is broadcast
to the other ranks (over the group's gloo group), whose reads return the same messages
in the same order. Every rank thus makes the same decisions (admission, retraction,
batches) and calls the model's collectives in step, with no batch message of its own
to keep in sync. A follower's outputs go nowhere: rank 0 sends them. The loop reads in
the same sequence on every rank because it branches only on state those reads built.
This module must not decide anything itself."""

from __future__ import annotations

from sgl.core.protocol import Message
from sgl.sched.models.parallel import TPGroup
from sgl.transports.channel import Receiver, Sender


class LeaderReceiver(Receiver):
    """Rank 0's receiver: the real one, each read broadcast to the followers."""

    def __init__(self, inner: Receiver, tp: TPGroup) -> None:
        self.inner = inner
        self.tp = tp

    def recv(self, timeout: float | None = None) -> Message | None:
        msg = self.inner.recv(timeout)
        return self.tp.broadcast_object(msg)

    def recv_all_nowait(self) -> list[Message]:
        return self.tp.broadcast_object(self.inner.recv_all_nowait())

    async def recv_async(self) -> Message:
        raise RuntimeError("the scheduler's receiver is read synchronously")

    def count_into(self, counts: dict[str, float]) -> None:
        self.inner.count_into(counts)

    def close(self) -> None:  # the role's last act: the group goes with its channel
        self.inner.close()
        self.tp.close()


class FollowerReceiver(Receiver):
    """Rank > 0's receiver: whatever rank 0 read, in the same call. A timeout is rank 0's
    to keep: a follower waits as long as rank 0 does."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp

    def recv(self, timeout: float | None = None) -> Message | None:
        return self.tp.broadcast_object(None)

    def recv_all_nowait(self) -> list[Message]:
        return self.tp.broadcast_object(None)

    async def recv_async(self) -> Message:
        raise RuntimeError("the scheduler's receiver is read synchronously")

    def close(self) -> None:
        self.tp.close()


class DropSender(Sender):
    """A follower's outputs: rank 0 sends the same ones."""

    def send(self, msg: Message) -> None:
        pass

    def close(self) -> None:
        pass
