"""Req: one request's state inside the scheduler.

KV ownership: `prefix_indices` are slots owned by the radix tree (locked through
`last_node` while the request runs); req_to_token[row, len(prefix_indices):kv_len]
are slots the request owns itself until it is cached or freed."""

from __future__ import annotations

from typing import Any

import torch

from sgl.sampling_params import SamplingParams

_EMPTY = torch.empty(0, dtype=torch.int64)


class Req:
    __slots__ = (
        "rid", "origin_input_ids", "sampling_params", "stream", "output_ids", "req_pool_idx",
        "prefix_indices", "last_node", "kv_len", "extend_len", "finished_reason", "sent_len",
        "cached_tokens", "generator", "to_abort", "retractions", "inflight", "epoch",
    )

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams, stream: bool) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.sampling_params = sampling_params
        self.stream = stream
        self.output_ids: list[int] = []
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: Any = None
        self.kv_len = 0  # tokens whose KV is written, all in req_to_token[row, :kv_len]
        self.extend_len = 0  # tokens the current prefill chunk computes
        self.finished_reason: dict[str, Any] | None = None
        self.sent_len = 0  # output ids already sent to the detokenizer
        self.cached_tokens = 0
        self.generator: torch.Generator | None = None
        self.to_abort: str | None = None
        self.retractions = 0
        self.inflight = 0  # launched batches holding this request whose results are not processed yet
        self.epoch = 0  # bumped on retraction: results launched before it are stale

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def fill_ids(self) -> list[int]:
        """The tokens whose KV is written (what the radix cache may insert)."""
        return self.all_ids[: self.kv_len]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, in={len(self.origin_input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"
