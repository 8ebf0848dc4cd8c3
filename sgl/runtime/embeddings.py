"""An embedding's shape on the caller's side: the scheduler's vector (little-endian
float32 bytes, pooled and normalised as the model says) truncated to `dimensions` when
the model was trained for it (Matryoshka), and renormalised when the model normalises,
then given as floats or as OpenAI's base64 bytes. No torch: stdlib arrays.

`Embeddings` is built from the scheduler's server info entry "embedding"
(sgl.sched.models.pooling.PoolingConfig.info), None when the model serves none."""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Mapping
from typing import Any

NO_EMBEDDINGS = ("model: this model serves no embeddings (no sentence-transformers Pooling module): start the "
                 "engine with is_embedding (--is-embedding)")


class Embeddings:
    def __init__(self, info: Mapping[str, Any] | None) -> None:
        self.info = info  # None: the model serves no embeddings

    def check(self, dimensions: int | None) -> None:
        """Raise a ValueError naming the field when this model cannot answer."""
        if self.info is None:
            raise ValueError(NO_EMBEDDINGS)
        if dimensions is None:
            return
        hidden, allowed = int(self.info["hidden_size"]), self.info.get("matryoshka")
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise ValueError(f"dimensions={dimensions!r} is invalid: must be an int")
        if allowed is None:
            raise ValueError(f"dimensions={dimensions} is invalid: this model does not support Matryoshka "
                             f"truncation (its config.json has no is_matryoshka); its embeddings have {hidden}")
        if allowed and dimensions not in allowed:
            raise ValueError(f"dimensions={dimensions} is invalid: this model allows {sorted(allowed)}")
        if not 1 <= dimensions <= hidden:
            raise ValueError(f"dimensions={dimensions} is invalid: must lie in [1, {hidden}]")

    def shape(self, raw: bytes, dimensions: int | None) -> array:
        """The vector (float32), truncated to `dimensions` (checked) and renormalised."""
        v = array("f")
        v.frombytes(raw)
        if sys.byteorder == "big":
            v.byteswap()
        if dimensions is None or dimensions >= len(v):
            return v
        v = v[:dimensions]
        if self.info is not None and self.info.get("normalize"):
            norm = math.sqrt(math.fsum(x * x for x in v))
            v = array("f", (x / max(norm, 1e-12) for x in v))
        return v


def le_bytes(v: array) -> bytes:
    """A float32 array as little-endian bytes (OpenAI's base64 payload)."""
    if sys.byteorder == "big":
        v = array("f", v)
        v.byteswap()
    return v.tobytes()
