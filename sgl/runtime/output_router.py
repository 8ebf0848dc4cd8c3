"""Where the detokenizer's outputs go: to the engine's own tokenizer manager, or to
a tokenizer manager in another process that attached over the tcp transport.

An attached client is known by its client id: its rids travel as
"<client_id>:<rid>" and its control requests carry `origin=client_id`. The
router is a Sender, so the detokenizer sends through it unchanged. It never
decodes text and never drops an output of a known client.

Routes are opened by a callable from the engine's transport security
(sgl.runtime.identity.Security.route): under CURVE a route connects only to the
holder of that client's key, and the scheduler's policy has already checked that
an AttachReq names its sender's own client id, so a second attach under an id
comes from the same key and replaces the first. Where ids are not bound to keys
(the shared-key mode) a second attach under an attached id is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sgl.core.log import get_logger
from sgl.core.protocol import (
    CONTROL_REPLIES,
    AttachReq,
    AttachReqOutput,
    BatchStrOutput,
    DetachReq,
    Message,
)
from sgl.transports.channel import ChannelFull, Sender
from sgl.transports.factory import open_sender

RID_SEP = ":"

# (client_id, address) -> a non-blocking sender to that client; ValueError refuses the attach.
RouteOpener = Callable[[str, str], Sender]


def plain_route(client_id: str, address: str) -> Sender:
    return open_sender(address, block=False)


def client_of(rid: str) -> str:
    """The client id a wire rid belongs to ("" when it has none)."""
    head, sep, _ = rid.partition(RID_SEP)
    return head if sep else ""


class OutputRouter(Sender):
    def __init__(self, default: Sender, open_route: RouteOpener | None = None, replace: bool = False) -> None:
        self.default = default
        self.open_route = open_route or plain_route
        self.replace = replace  # a second attach under an attached id replaces the route (ids bound to keys)
        self.routes: dict[str, Sender] = {}
        self.log = get_logger("output_router")

    def send(self, msg: Message) -> None:
        if isinstance(msg, AttachReq):
            self._attach(msg)
        elif isinstance(msg, DetachReq):
            route = self.routes.pop(msg.client_id, None)
            if route is not None:
                route.close()
        elif isinstance(msg, BatchStrOutput) and self.routes:
            self._split(msg)
        elif isinstance(msg, CONTROL_REPLIES) and msg.origin:
            self._to_client(msg.origin, msg)
        else:
            self.default.send(msg)

    def _attach(self, msg: AttachReq) -> None:
        if not msg.address.startswith("tcp://") or not msg.client_id or RID_SEP in msg.client_id:
            self.log.warning("refused attach", client_id=msg.client_id, address=msg.address)
            return
        if msg.client_id in self.routes and not self.replace:
            self.log.warning("refused attach: that client id is attached already", client_id=msg.client_id,
                             address=msg.address)
            return
        try:
            # Never blocking: a client that went away must not stall the outputs of everyone else.
            route = self.open_route(msg.client_id, msg.address)
        except ValueError as e:
            self.log.warning("refused attach", client_id=msg.client_id, address=msg.address, error=str(e))
            return
        old = self.routes.pop(msg.client_id, None)
        if old is not None:
            old.close()
        self.routes[msg.client_id] = route
        self._to_client(msg.client_id, AttachReqOutput(msg.client_id, True))
        self.log.info("client attached", client_id=msg.client_id, address=msg.address)

    def _to_client(self, client: str, msg: Message) -> None:
        """Send to an attached client; one whose queue is full (it stopped reading or went
        away) is detached and its queued outputs dropped, logged once."""
        route = self.routes.get(client)
        if route is None:
            return
        try:
            route.send(msg)
        except ChannelFull as e:
            self.routes.pop(client, None)
            route.close()
            self.log.warning("dropped an attached client that stopped reading", client_id=client, error=str(e))

    def _split(self, b: BatchStrOutput) -> None:
        groups: dict[str, list[int]] = {}
        for i, rid in enumerate(b.rids):
            c = client_of(rid)
            groups.setdefault(c if c in self.routes else "", []).append(i)
        for client, idx in groups.items():
            # Every field is a per-rid column: take each one's rows, whatever columns exist
            # (an optional column left empty, as `beams` by a sender without it, stays empty).
            cols: dict[str, Any] = {f: ([col[i] for i in idx] if col else []) if isinstance(col := getattr(b, f), list)
                                    else col for f in BatchStrOutput.__struct_fields__}
            part = b if len(idx) == len(b.rids) else BatchStrOutput(**cols)
            if client:
                self._to_client(client, part)
            else:
                self.default.send(part)

    def close(self) -> None:
        for route in self.routes.values():
            route.close()
        self.routes.clear()
        self.default.close()
