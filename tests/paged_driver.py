"""A minimal stand-in for the model runner, for model tests: request rows from
ReqToTokenPool, KV slots from TokenToKVPoolAllocator, one packed (ragged)
ForwardBatch per step over TorchAttentionBackend, greedy argmax. It knows nothing
of scheduling or the radix cache; prefix sharing is done by copying slot ids."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sgl.cache.kv_allocator import TokenToKVPoolAllocator
from sgl.cache.kv_pool import MHATokenToKVPool
from sgl.cache.req_to_token_pool import ReqToTokenPool
from sgl.kernels.attention import AttnMetadata
from sgl.kernels.torch_attention import TorchAttentionBackend
from sgl.sched.models.forward_batch import ForwardBatch


class PagedDriver:
    def __init__(self, model: nn.Module, *, max_reqs: int = 8, max_context: int = 512, kv_slots: int = 4096) -> None:
        self.model = model
        dtype = next(model.parameters()).dtype
        self.kv_pool = MHATokenToKVPool(kv_slots, model.num_layers, model.num_kv_heads, model.head_dim, dtype)
        self.allocator = TokenToKVPoolAllocator(kv_slots)
        self.req_pool = ReqToTokenPool(max_reqs, max_context)
        self.backend = TorchAttentionBackend()
        self.seq_len: dict[int, int] = {}

    def new_request(self, shared_prefix_of: int | None = None, prefix_len: int = 0) -> int:
        """A fresh row; with `shared_prefix_of`, its first `prefix_len` tokens reuse
        that row's KV slots (as a radix-cache hit would)."""
        row = self.req_pool.alloc()
        assert row is not None
        if shared_prefix_of is not None:
            src = self.req_pool.req_to_token[shared_prefix_of, :prefix_len]
            self.req_pool.write(row, 0, src)
        self.seq_len[row] = prefix_len
        return row

    def extend(self, rows: list[int], new_tokens: list[list[int]]) -> torch.Tensor:
        """One forward over the new tokens of every row (packed); float32 logits [B, V]."""
        ids, pos, locs, kv_idx = [], [], [], []
        qo_lens, kv_lens = [], []
        for row, toks in zip(rows, new_tokens, strict=True):
            start, n = self.seq_len[row], len(toks)
            slots = self.allocator.alloc(n)
            assert slots is not None, "test KV pool too small"
            self.req_pool.write(row, start, slots)
            self.seq_len[row] = start + n
            ids.append(torch.tensor(toks, dtype=torch.int64))
            pos.append(torch.arange(start, start + n, dtype=torch.int64))
            locs.append(slots)
            kv_idx.append(self.req_pool.req_to_token[row, : start + n].to(torch.int64))
            qo_lens.append(n)
            kv_lens.append(start + n)
        qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
        kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
        meta = AttnMetadata(
            is_decode=all(n == 1 for n in qo_lens),
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=torch.cat(kv_idx),
            qo_lens=qo_lens,
            kv_lens=kv_lens,
        )
        fb = ForwardBatch(
            input_ids=torch.cat(ids),
            positions=torch.cat(pos),
            out_cache_loc=torch.cat(locs),
            logits_indices=(qo_indptr[1:] - 1).to(torch.int64),
            attn=meta,
            attn_backend=self.backend,
            kv_pool=self.kv_pool,
        )
        self.backend.begin_forward(meta)
        return self.model.forward(fb)

    def generate(
        self, rows: list[int], new_tokens: list[list[int]], max_new: int, eos: int | None = None
    ) -> list[list[int]]:
        """Prefill `new_tokens` of all rows in one batch, then decode all together, greedily.
        A row that produced `eos` stops taking part."""
        out: list[list[int]] = [[] for _ in rows]
        logits = self.extend(rows, new_tokens)
        live = list(range(len(rows)))
        for step in range(max_new):
            nxt = logits.argmax(-1).tolist()
            for i, t in zip(live, nxt, strict=True):
                out[i].append(t)
            live = [i for i in live if out[i][-1] != eos]
            if step == max_new - 1 or not live:
                break
            logits = self.extend([rows[i] for i in live], [[out[i][-1]] for i in live])
        return out


def converted_default_model(cache_dir: str) -> str:
    """The default model converted into `cache_dir` (once: later calls reuse it)."""
    from sgl.sched.models.default_model import default_model_dir

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGL_CACHE_DIR", cache_dir)
        return default_model_dir()
