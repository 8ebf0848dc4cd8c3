"""Encode and decode protocol messages. No pickle: a frame is MessagePack of one
tagged Struct from sgl.core.protocol.Message; anything else fails to decode."""

from __future__ import annotations

import msgspec

from sgl.core.protocol import Message

MAX_FRAME_BYTES = 64 * 1024 * 1024


class DecodeError(ValueError):
    """A frame that is not a well-formed protocol message."""


class EncodeError(ValueError):
    """A message holding a value MessagePack cannot carry (an integer past 64 bits, a
    string with a lone surrogate, an object): the caller's value, refused before it is sent."""


class Codec:
    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Message)

    def encode(self, msg: Message) -> bytes:
        try:
            return self._enc.encode(msg)
        except (TypeError, OverflowError, UnicodeEncodeError) as e:
            raise EncodeError(f"a value of the request cannot be sent to the engine's roles ({e}): integers must "
                              "fit in 64 bits and text must be valid Unicode") from None

    def decode(self, frame: bytes | memoryview) -> Message:
        if len(frame) > MAX_FRAME_BYTES:
            raise DecodeError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
        try:
            return self._dec.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise DecodeError(str(e)) from None
