"""Frame authentication for the tcp transport's shared-key mode (`transport_key`):
HMAC-SHA256 over each frame, with a per-sender session id and sequence number so
that a receiver drops replayed and reordered frames.

A frame is tag(32) | session(16) | seq(8, big-endian) | payload, the tag over
everything after it (and a format label). Every sender starts a fresh random session at seq 0; a
receiver remembers the highest seq of each session it saw (a bounded table) and
accepts only higher ones. Limits of this mode, which CURVE (keys.py, curve.py)
does not have: a frame can be replayed into a receiver that restarted (it has
forgotten the session), or into another channel under the same key; frames are
not encrypted; every key holder is the same identity.

It signs and checks bytes only; it must not decode messages or decide policy
beyond which addresses may be listened on without a key."""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import os
import struct

TAG_BYTES = 32
SESSION_BYTES = 16
HEADER_BYTES = TAG_BYTES + SESSION_BYTES + 8
MAX_SESSIONS = 65536  # remembered per receiver; the oldest is forgotten first
_SEQ = struct.Struct(">Q")
_DOMAIN = b"sgl frame v2\0"  # in every tag, not on the wire: a frame of the old format (no session) never verifies


class AuthError(ValueError):
    """A frame whose tag is missing or wrong."""


def new_session() -> bytes:
    return os.urandom(SESSION_BYTES)


def sign(key: bytes, session: bytes, seq: int, payload: bytes) -> bytes:
    body = session + _SEQ.pack(seq) + payload
    return _tag(key, body) + body


def _tag(key: bytes, body: bytes | memoryview) -> bytes:
    h = hmac.new(key, _DOMAIN, hashlib.sha256)
    h.update(body)
    return h.digest()


def verify(key: bytes, frame: bytes | memoryview) -> tuple[bytes, int, memoryview]:
    """(session, seq, payload) of a correctly signed frame; AuthError otherwise."""
    data = memoryview(frame)
    if len(data) < HEADER_BYTES:
        raise AuthError(f"frame of {len(data)} bytes is shorter than its {HEADER_BYTES}-byte header")
    body = data[TAG_BYTES:]
    if not hmac.compare_digest(data[:TAG_BYTES], _tag(key, body)):
        raise AuthError("frame tag does not match: wrong key or tampered frame")
    return bytes(body[:SESSION_BYTES]), _SEQ.unpack_from(body, SESSION_BYTES)[0], body[SESSION_BYTES + 8:]


class ReplayGuard:
    """The highest sequence number seen per session; a frame at or below it is a replay
    (or arrived out of order) and is refused. Gaps are fine: frames can be lost when a
    connection breaks."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.last: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.max_sessions = max_sessions

    def accept(self, session: bytes, seq: int) -> bool:
        prev = self.last.get(session)
        if prev is not None and seq <= prev:
            return False
        self.last[session] = seq
        self.last.move_to_end(session)
        if len(self.last) > self.max_sessions:
            self.last.popitem(last=False)
        return True


def is_loopback(address: str) -> bool:
    """Whether a tcp:// address names this host only (127.0.0.0/8, ::1, localhost)."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def key_bytes(key: str | None) -> bytes | None:
    return None if key is None else bytes.fromhex(key)
