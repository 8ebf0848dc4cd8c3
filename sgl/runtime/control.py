"""Control calls of the tokenizer manager (flush_cache, server_info, health, attach):
each request gets a fresh `req_id` that its reply echoes, so a lost reply fails only
its own call; a message type without a req_id (AttachReqOutput) is matched by type
and order. Every call runs under `anyio.fail_after` and raises a TimeoutError
naming the call.

It sends through the given Sender and is fed replies by the tokenizer manager's
receive loop; it knows nothing of generate requests. Behind data parallelism a call
with a req_id reaches every replica (`fanout` of them): it completes with `merge` of
all their replies."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import anyio

from sgl.core.log import get_logger
from sgl.core.protocol import Message
from sgl.transports.channel import Sender


class ControlCalls:
    def __init__(self, send: Sender, timeout: float, fanout: int = 1,
                 merge: Callable[[list[Message]], Message] | None = None, quiet_late: bool = False) -> None:
        self.send = send
        self.quiet_late = quiet_late  # a late reply is routine (a cancelled tokenizer call): debug, not warning
        self.timeout = timeout
        self.fanout = fanout
        self.merge = merge
        self.partial: dict[int, list[Message]] = {}  # replies so far of a fanned-out call
        self._ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[Any]] = {}  # replies awaited, by req_id
        self.by_type: dict[type, list[asyncio.Future[Any]]] = {}  # replies without a req_id
        self.log = get_logger("tokenizer_manager")

    async def call(self, req: Message, reply_type: type, timeout: float | None = None) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        key = 0
        if hasattr(req, "req_id"):
            key = next(self._ids)
            req.req_id = key
            self.pending[key] = fut
        else:
            self.by_type.setdefault(reply_type, []).append(fut)
        limit = self.timeout if timeout is None else timeout
        try:
            with anyio.fail_after(limit):
                self.send.send(req)
                return await fut
        except TimeoutError:
            raise TimeoutError(f"{type(req).__name__}: no {reply_type.__name__} within {limit:g} s") from None
        finally:
            if key:
                self.pending.pop(key, None)
                self.partial.pop(key, None)
            elif fut in (futs := self.by_type.get(reply_type, [])):
                futs.remove(fut)

    def reply(self, msg: Message) -> None:
        key = getattr(msg, "req_id", 0)
        if key:
            if key in self.pending and self.fanout > 1:
                got = self.partial.setdefault(key, [])
                got.append(msg)
                if len(got) < self.fanout:
                    return
                del self.partial[key]
                assert self.merge is not None
                msg = self.merge(got)
            fut = self.pending.pop(key, None)
            if fut is None:  # its call timed out or was cancelled
                (self.log.debug if self.quiet_late else self.log.warning)(
                    "dropped a late control reply", type=type(msg).__name__, req_id=key)
                return
        elif futs := self.by_type.get(type(msg)):
            fut = futs.pop(0)
        else:
            return
        if not fut.done():
            fut.set_result(msg)

    def fail(self, error: BaseException) -> None:
        for fut in [*self.pending.values(), *(f for futs in self.by_type.values() for f in futs)]:
            if not fut.done():
                fut.set_exception(error)
        self.pending.clear()
        self.partial.clear()
        self.by_type.clear()
