"""Frame authentication for the tcp transport: HMAC-SHA256 over each frame with a
shared secret, the 32-byte tag in front of the payload.

It signs and checks bytes only; it must not decode messages or decide policy
beyond which addresses may be listened on without a key."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

TAG_BYTES = 32


class AuthError(ValueError):
    """A frame whose tag is missing or wrong."""


def sign(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest() + payload


def verify(key: bytes, frame: bytes | memoryview) -> bytes:
    """The payload of a correctly signed frame; AuthError otherwise."""
    data = bytes(frame)
    if len(data) < TAG_BYTES:
        raise AuthError(f"frame of {len(data)} bytes is shorter than its {TAG_BYTES}-byte tag")
    tag, payload = data[:TAG_BYTES], data[TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(key, payload, hashlib.sha256).digest()):
        raise AuthError("frame tag does not match: wrong key or tampered frame")
    return payload


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
