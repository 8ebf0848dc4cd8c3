"""Who may do what over the tcp transport, and the channels that carry it.

`Security` is an engine's transport mode and its key material, made once by the
engine (`Security.of(args)`) and handed to its roles in their ChildConfig:
- "curve": the server's key pair and the client keys it accepts, from
  `--transport-keys DIR` or, without it, an ephemeral set made per engine (then
  nothing outside the engine can attach). The engine's own roles all use the
  server's pair; its own tokenizer manager is therefore the one "internal" peer.
- "hmac": the legacy shared key (`transport_key` / SGL_TRANSPORT_KEY): frames are
  signed and numbered, not encrypted, and every key holder is trusted alike.
- "none": not tcp (inproc and ipc need no keys).

A client's identity is its public key; its client id is derived from it
(`client_id_of`), so no client can choose another's. `scheduler_policy` is the hook
the scheduler's receiver calls for every message with its sender: a client's rids
must carry its own client id, it may attach, detach and ask for replies only as
itself, and only admin keys (`DIR/admin/`, and the engine itself) may shut the
server down, flush its cache or send any control-plane request (pause, abort all,
weights, memory: protocol.CONTROL_PLANE). A refused message is dropped without a
reply (the transport counts it), so its sender's call times out.

It builds channels and decides rights; it never looks inside a request beyond its
ids, and the transport below it stays free of message policy."""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Literal

import msgspec
from zmq.utils import z85

from sgl.core.protocol import (
    CONTROL_PLANE,
    AbortReq,
    AttachReq,
    DetachReq,
    FlushCacheReq,
    GenerateReqInput,
    GetServerInfoReq,
    HealthCheckReq,
    Message,
    ShutdownReq,
)
from sgl.core.server_args import ServerArgs
from sgl.runtime.output_router import RID_SEP
from sgl.transports.channel import Peer, Policy, Receiver, Sender
from sgl.transports.curve import CurveClient, CurveServer
from sgl.transports.factory import open_receiver, open_sender
from sgl.transports.keys import KeyPair, KeySet, ephemeral_keyset, load_key_dir, load_pair, load_public

CLIENT_ID_HEX = 24  # 96 bits of the key's hash: no one finds a second key with another's id
ENV_KEY = "SGL_TRANSPORT_KEY"

Mode = Literal["none", "hmac", "curve"]
Role = Literal["scheduler", "detokenizer", "tokenizer"]


def client_id_of(public_key: str) -> str:
    """The client id bound to a CURVE public key (z85): "k" and 24 hex digits of its SHA-256."""
    return "k" + hashlib.sha256(z85.decode(public_key)).hexdigest()[:CLIENT_ID_HEX]


class Security(msgspec.Struct, frozen=True):
    mode: Mode
    hmac_key: str | None = None  # "hmac": the shared key (hex)
    keys: KeySet | None = None  # "curve": the server's pair and its clients' public keys

    @classmethod
    def of(cls, args: ServerArgs) -> Security:
        """The mode an engine's arguments ask for. An ephemeral CURVE set is made here:
        call it once per engine and pass the result to the roles."""
        if args.transport != "tcp":
            return cls("none")
        if args.transport_keys is not None:
            return cls("curve", keys=load_key_dir(args.transport_keys))
        key = args.transport_key or os.environ.get(ENV_KEY)
        if key:
            return cls("hmac", hmac_key=key)
        return cls("curve", keys=ephemeral_keyset())

    @property
    def identity_bound(self) -> bool:
        """Whether a client id is bound to a key (then a re-attach can only come from its owner)."""
        return self.mode == "curve"

    def _pair(self) -> KeyPair:
        assert self.keys is not None
        return self.keys.server

    def receiver(self, address: str, role: Role) -> Receiver:
        """The bound end of one of the engine's own channels. The scheduler's accepts the
        engine and its clients, under `scheduler_policy`; the others only the engine."""
        if self.mode != "curve":
            return open_receiver(address, self.hmac_key)
        assert self.keys is not None
        if role == "scheduler":
            return open_receiver(address, curve=CurveServer(self._pair(), tuple(sorted(self.keys.allowed()))),
                                 policy=scheduler_policy(self.keys))
        return open_receiver(address, curve=CurveServer(self._pair(), (self._pair().public,)))

    def sender(self, address: str, block: bool = True) -> Sender:
        """The connecting end of one of the engine's own channels."""
        if self.mode != "curve":
            return open_sender(address, self.hmac_key, block)
        return open_sender(address, block=block, curve=CurveClient(self._pair(), self._pair().public))

    def route(self, client_id: str, address: str) -> Sender:
        """The detokenizer's non-blocking sender to an attached client's socket. Under
        CURVE it connects only to the holder of that client's key (its socket is a
        CURVE server with that key); ValueError for a client id no allowed key has."""
        if self.mode != "curve":
            return open_sender(address, self.hmac_key, block=False)
        assert self.keys is not None
        public = client_keys(self.keys).get(client_id)
        if public is None:
            raise ValueError(f"no allowed key has client id {client_id!r}")
        return open_sender(address, block=False, curve=CurveClient(self._pair(), public))


def client_keys(keys: KeySet) -> dict[str, str]:
    """Client id -> public key, for every allowed client."""
    out = {client_id_of(k): k for k in (*keys.clients, *keys.admins)}
    if len(out) != len(set((*keys.clients, *keys.admins))):
        raise ValueError("two allowed client keys share a client id")  # never by chance: 96 bits
    return out


ADMIN_ONLY = (ShutdownReq, FlushCacheReq, *CONTROL_PLANE)
ANSWERED = (FlushCacheReq, GetServerInfoReq, HealthCheckReq, *CONTROL_PLANE)  # replies go to `origin`


def _own(rid: str | None, cid: str) -> bool:
    return rid is None or rid.startswith(cid + RID_SEP)


def scheduler_policy(keys: KeySet) -> Policy:
    """The hook of the scheduler's receiver: None lets a message through, else the reason
    it is refused. The engine's own tokenizer manager (the server's key) may do anything."""
    internal = keys.server.public
    admins = frozenset((*keys.admins, internal))
    ids: dict[str, str] = {}

    def check(msg: Message, peer: Peer) -> str | None:
        if peer.key == internal:
            return None
        cid = ids.get(peer.key)
        if cid is None:
            cid = ids[peer.key] = client_id_of(peer.key)
        if isinstance(msg, GenerateReqInput):
            ok = _own(msg.rid, cid) and _own(msg.prefix_leader, cid)
            return None if ok else f"rid {msg.rid!r} is not under the sender's client id {cid}"
        if isinstance(msg, AbortReq):
            return None if _own(msg.rid, cid) else f"abort of rid {msg.rid!r}, not one of client {cid}"
        if isinstance(msg, (AttachReq, DetachReq)):
            return None if msg.client_id == cid else f"client {cid} may not attach or detach as {msg.client_id!r}"
        if isinstance(msg, ADMIN_ONLY) and peer.key not in admins:
            return f"{type(msg).__name__} needs an admin key; client {cid} has none"
        if isinstance(msg, ANSWERED):
            return None if msg.origin == cid else f"client {cid} asked for a reply to {msg.origin!r}"
        if isinstance(msg, ShutdownReq):
            return None
        return f"{type(msg).__name__} is not a request a client sends"

    return check


def attach_channels(scheduler_address: str, host: str, transport_key: str | None, keys: str | None,
                    server_key: str | None) -> tuple[Sender, Receiver, str]:
    """A client's channels to a running engine: (sender to its scheduler, bound receiver
    for its outputs, client id). With `keys` (this client's NAME.key_secret) and
    `server_key` (the server's server.key, or its z85 text), CURVE: the receiver
    accepts only the server's key and the client id is the key's. Otherwise the
    shared key (hex, or SGL_TRANSPORT_KEY) and a random client id. The sender never
    blocks (it raises ChannelFull): it is used on the caller's event loop, and a
    connection whose handshake the server refused leaves a PUSH socket with no peer,
    where a blocking send would wait forever."""
    if keys is None and server_key is None:
        key = transport_key if transport_key is not None else os.environ.get(ENV_KEY)
        recv = open_receiver(f"tcp://{host}:0", key)
        return open_sender(scheduler_address, key, block=False), recv, "c" + uuid.uuid4().hex[:16]
    if keys is None or server_key is None:
        raise ValueError("keys and server_key go together: this client's NAME.key_secret and the server's server.key")
    pair, server_public = load_pair(keys), load_public(server_key)
    recv = open_receiver(f"tcp://{host}:0", curve=CurveServer(pair, (server_public,)))
    return (open_sender(scheduler_address, block=False, curve=CurveClient(pair, server_public)), recv,
            client_id_of(pair.public))
