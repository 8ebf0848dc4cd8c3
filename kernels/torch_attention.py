"""Reference attention over the paged KV pool in pure torch (CPU and GPU).

Each forward pads the batch once into [B, max_q] queries and [B, max_kv] KV slot
gathers with one boolean mask, so every layer is a gather plus one batched SDPA
call, with no per-request Python loop (a mixed batch: one such group for its prompt
chunks, one for its decode rows). A cascade batch (shared prefix + suffixes)
is reassembled into the same per-request gathers: the reference for what a cascade
must compute, not a faster path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl.kernels.attention import AttentionBackend, AttnMetadata


class _Rows:
    """One padded group of a batch's rows: where each query and KV slot comes from, the
    mask, and which padded query rows are real."""

    __slots__ = ("q_idx", "kv_idx", "mask", "valid", "mask_rep")

    def __init__(self, meta: AttnMetadata, lo: int, hi: int) -> None:
        dev = meta.kv_indices.device
        qo, kv = meta.qo_lens[lo:hi], meta.kv_lens[lo:hi]
        qo_lens = torch.tensor(qo, dtype=torch.int64, device=dev)
        kv_lens = torch.tensor(kv, dtype=torch.int64, device=dev)
        max_q, max_kv = max(qo), max(kv)
        qo_start = meta.qo_indptr[lo:hi].to(torch.int64)
        kv_start = meta.kv_indptr[lo:hi].to(torch.int64)
        qpos = torch.arange(max_q, device=dev)
        kpos = torch.arange(max_kv, device=dev)
        q_valid = qpos[None, :] < qo_lens[:, None]  # [B, max_q]
        kv_valid = kpos[None, :] < kv_lens[:, None]  # [B, max_kv]
        self.q_idx = torch.where(q_valid, qo_start[:, None] + qpos[None, :], 0)
        if (c := meta.cascade) is None or meta.decode_from is not None:  # every row's slots in kv_indices
            kv_flat = torch.where(kv_valid, kv_start[:, None] + kpos[None, :], 0)
            self.kv_idx = torch.where(kv_valid, meta.kv_indices[kv_flat], 0)
        else:
            own_start = c.suffix_indptr_host[lo:hi].to(dev, torch.int64)
            in_own = kv_valid & (kpos[None, :] >= c.shared_len)
            own_flat = torch.where(in_own, own_start[:, None] + kpos[None, :] - c.shared_len, 0)
            shared = c.shared_indices[kpos.clamp(max=max(c.shared_len - 1, 0))]
            self.kv_idx = torch.where(in_own, c.suffix_indices[own_flat], torch.where(kv_valid, shared[None, :], 0))
        # Query j of request i sits at absolute position kv_len - qo_len + j.
        q_abs = (kv_lens - qo_lens)[:, None] + qpos[None, :]  # [B, max_q]
        mask = (kpos[None, None, :] <= q_abs[:, :, None]) & kv_valid[:, None, :]
        # Padded query rows attend to slot 0 alone, so softmax never sees an empty row.
        mask[:, :, 0] |= ~q_valid
        self.mask = mask[:, None]  # [B, 1, max_q, max_kv]
        self.mask_rep: tuple[int, torch.Tensor] | None = None
        self.valid = q_valid

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        qp = q[self.q_idx].transpose(1, 2)  # [B, Hq, max_q, D]
        b, hq, lq, d = qp.shape
        shape = (*self.kv_idx.shape, *k_cache.shape[1:])  # [B, max_kv, Hkv, D]: new tokens included
        flat = self.kv_idx.view(-1)
        k = k_cache.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, max_kv, D]
        v = v_cache.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)
        rep = hq // k.shape[1]
        # GQA without copying K/V per query head: query head h reads KV head h // rep, so the
        # rep query heads of a KV head become rep blocks of rows of one attention problem.
        qg = qp.reshape(b, k.shape[1], rep * lq, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=self._grouped_mask(rep), scale=scale)
        return out.reshape(b, hq, lq, d).transpose(1, 2)[self.valid]  # [T, Hq, D], in qo_indptr order

    def _grouped_mask(self, rep: int) -> torch.Tensor:
        """The mask for rep query heads stacked along the rows (built once per batch)."""
        if rep == 1:
            return self.mask
        if self.mask_rep is None or self.mask_rep[0] != rep:
            self.mask_rep = (rep, self.mask.repeat(1, 1, rep, 1))
        return self.mask_rep[1]


class TorchAttentionBackend(AttentionBackend):
    supports_cascade = True

    def __init__(self) -> None:
        self._groups: list[_Rows] = []

    def begin_forward(self, meta: AttnMetadata) -> None:
        b, d = len(meta.qo_lens), meta.decode_from
        # A mixed batch's decode rows (one query each) are padded apart from its prompt
        # chunks: padded together, each would take the longest chunk's query rows.
        spans = [(0, b)] if d is None or d in (0, b) else [(0, d), (d, b)]
        self._groups = [_Rows(meta, lo, hi) for lo, hi in spans]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        assert self._groups
        outs = [g.attend(q, k_cache, v_cache, scale) for g in self._groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
