"""Reference attention over the paged KV pool in pure torch (CPU and GPU).

Each forward pads the batch once into [B, max_q] queries and [B, max_kv] KV slot
gathers with one boolean mask, so every layer is a gather plus one batched SDPA
call, with no per-request Python loop. A cascade batch (shared prefix + suffixes)
is reassembled into the same per-request gathers: the reference for what a cascade
must compute, not a faster path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl.kernels.attention import AttentionBackend, AttnMetadata


class TorchAttentionBackend(AttentionBackend):
    supports_cascade = True

    def __init__(self) -> None:
        self._q_idx: torch.Tensor | None = None
        self._kv_idx: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self._mask_rep: tuple[int, torch.Tensor] | None = None

    def begin_forward(self, meta: AttnMetadata) -> None:
        dev = meta.kv_indices.device
        qo_lens = torch.tensor(meta.qo_lens, dtype=torch.int64, device=dev)
        kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int64, device=dev)
        max_q, max_kv = max(meta.qo_lens), max(meta.kv_lens)
        qo_start = meta.qo_indptr[:-1].to(torch.int64)
        kv_start = meta.kv_indptr[:-1].to(torch.int64)
        qpos = torch.arange(max_q, device=dev)
        kpos = torch.arange(max_kv, device=dev)
        q_valid = qpos[None, :] < qo_lens[:, None]  # [B, max_q]
        kv_valid = kpos[None, :] < kv_lens[:, None]  # [B, max_kv]
        self._q_idx = torch.where(q_valid, qo_start[:, None] + qpos[None, :], 0)
        if (c := meta.cascade) is None or meta.decode_from is not None:  # every row's slots in kv_indices
            kv_flat = torch.where(kv_valid, kv_start[:, None] + kpos[None, :], 0)
            self._kv_idx = torch.where(kv_valid, meta.kv_indices[kv_flat], 0)
        else:
            own_start = c.suffix_indptr_host[:-1].to(dev, torch.int64)
            in_own = kv_valid & (kpos[None, :] >= c.shared_len)
            own_flat = torch.where(in_own, own_start[:, None] + kpos[None, :] - c.shared_len, 0)
            shared = c.shared_indices[kpos.clamp(max=max(c.shared_len - 1, 0))]
            self._kv_idx = torch.where(in_own, c.suffix_indices[own_flat], torch.where(kv_valid, shared[None, :], 0))
        # Query j of request i sits at absolute position kv_len - qo_len + j.
        q_abs = (kv_lens - qo_lens)[:, None] + qpos[None, :]  # [B, max_q]
        mask = (kpos[None, None, :] <= q_abs[:, :, None]) & kv_valid[:, None, :]
        # Padded query rows attend to slot 0 alone, so softmax never sees an empty row.
        mask[:, :, 0] |= ~q_valid
        self._mask = mask[:, None]  # [B, 1, max_q, max_kv]
        self._mask_rep = None
        self._valid = q_valid

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        assert self._q_idx is not None and self._kv_idx is not None
        qp = q[self._q_idx].transpose(1, 2)  # [B, Hq, max_q, D]
        b, hq, lq, d = qp.shape
        shape = (*self._kv_idx.shape, *k_cache.shape[1:])  # [B, max_kv, Hkv, D]: new tokens included
        flat = self._kv_idx.view(-1)
        k = k_cache.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, max_kv, D]
        v = v_cache.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)
        rep = hq // k.shape[1]
        # GQA without copying K/V per query head: query head h reads KV head h // rep, so the
        # rep query heads of a KV head become rep blocks of rows of one attention problem.
        qg = qp.reshape(b, k.shape[1], rep * lq, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=self._grouped_mask(rep), scale=scale)
        return out.reshape(b, hq, lq, d).transpose(1, 2)[self._valid]  # [T, Hq, D], in qo_indptr order

    def _grouped_mask(self, rep: int) -> torch.Tensor:
        """The mask for rep query heads stacked along the rows (built once per batch)."""
        assert self._mask is not None
        if rep == 1:
            return self._mask
        if self._mask_rep is None or self._mask_rep[0] != rep:
            self._mask_rep = (rep, self._mask.repeat(1, 1, rep, 1))
        return self._mask_rep[1]
