"""Addresses and channel construction for the three transports.

`make_addresses` picks the three channel addresses of one engine; `open_sender`
and `open_receiver` turn an address into a channel by its scheme
(inproc://, ipc://, tcp://). Over tcp a channel is CURVE (`curve=`), shared-key
HMAC (`key=`), or, on loopback only, plain; the other schemes ignore both."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid

import msgspec

from sgl.transports.auth import key_bytes
from sgl.transports.channel import Policy, Receiver, Sender
from sgl.transports.curve import CurveClient, CurveServer


class Addresses(msgspec.Struct, frozen=True):
    to_scheduler: str  # tokenizer manager -> scheduler
    to_detokenizer: str  # scheduler -> detokenizer
    to_tokenizer: str  # detokenizer -> tokenizer manager
    ipc_dir: str | None = None  # private socket folder to remove at shutdown


def free_tcp_ports(host: str, n: int) -> list[int]:
    """n distinct free ports: all held open until each is picked."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def make_addresses(transport: str, host: str = "127.0.0.1") -> Addresses:
    if transport == "inproc":
        tag = uuid.uuid4().hex
        return Addresses(f"inproc://{tag}/sched", f"inproc://{tag}/detok", f"inproc://{tag}/tok")
    if transport == "ipc":
        d = tempfile.mkdtemp(prefix="sgl-")
        os.chmod(d, 0o700)
        return Addresses(f"ipc://{d}/sched", f"ipc://{d}/detok", f"ipc://{d}/tok", ipc_dir=d)
    if transport == "tcp":
        ports = free_tcp_ports(host, 3)
        return Addresses(*(f"tcp://{host}:{p}" for p in ports))
    raise ValueError(f"transport={transport!r} is invalid: must be 'inproc', 'ipc' or 'tcp'")


def replica_addresses(addresses: Addresses, n: int, host: str = "127.0.0.1") -> list[Addresses]:
    """Data parallelism: n copies of `addresses`, each with a scheduler address of its own
    (the first is `addresses`); the detokenizer and tokenizer manager stay shared."""
    out = [addresses]
    if n > 1 and addresses.to_scheduler.startswith("tcp://"):
        out += [msgspec.structs.replace(addresses, to_scheduler=f"tcp://{host}:{p}")
                for p in free_tcp_ports(host, n - 1)]
    else:
        out += [msgspec.structs.replace(addresses, to_scheduler=f"{addresses.to_scheduler}-dp{k}")
                for k in range(1, n)]
    return out


def open_sender(address: str, key: str | None = None, block: bool = True, curve: CurveClient | None = None) -> Sender:
    """`curve` (this end's key pair and the receiver's public key) encrypts every frame
    on tcp://; else `key` (hex) signs it. A sender with `block=False` raises
    ChannelFull at its queue's bound instead of waiting (in-process queues are
    unbounded: both ends share one process's memory)."""
    if address.startswith("inproc://"):
        from sgl.transports.inproc import InprocSender

        return InprocSender(address)
    from sgl.transports.zmq_channel import ZmqSender

    return ZmqSender(address, key_bytes(key), block, curve)


def open_receiver(address: str, key: str | None = None, curve: CurveServer | None = None,
                  policy: Policy | None = None) -> Receiver:
    """On tcp://, `curve` (this end's key pair and the peer keys it accepts) makes it a
    CURVE server and `policy` is asked about every message with its sender (CURVE
    only: the other modes know no sender); else `key` (hex) is required of every
    frame."""
    if address.startswith("inproc://"):
        from sgl.transports.inproc import InprocReceiver

        return InprocReceiver(address)
    from sgl.transports.zmq_channel import ZmqReceiver

    return ZmqReceiver(address, key_bytes(key), curve, policy)
