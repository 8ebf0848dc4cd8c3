"""A stand-in for the part of FlashInfer's API that sgl's FlashInfer backend calls (its
batch wrappers' `plan` and `run`, and `merge_state`), computed in float32 torch on the
CPU, so that the backend's own bookkeeping (which rows, indptrs and KV slots each plan is
handed, how modes split and merge their outputs) is checked where CI runs. FlashInfer's
kernels themselves are checked against the torch reference on a GPU (tests/test_gpu.py).

As FlashInfer: attention is scaled by 1/sqrt(head_dim) (the backend passes no sm_scale),
a KV head serves Hq/Hkv consecutive query heads, a causal extend's query j of n sees its
first kv_len - n + j + 1 keys, and a row with no keys gives zeros with a log-sum-exp of
-inf. Log-sum-exps are base 2, as FlashInfer's (its kernels keep scores in log2 units), so
that a log-sum-exp sgl computes itself merges with these as it would with FlashInfer's.
In CUDA-graph mode (`use_cuda_graph=True`) a wrapper's plan copies its indptr and
indices into the buffers it was made with and its run reads them back, as a captured
graph does: whatever overwrote a shared buffer since is read.
A graph-mode paged prefill, as FlashInfer's, keeps its batch size and takes at most the
query tokens of its first plan; its run may be handed more query rows than the plan's
tokens (a graph's padding), which no request reads and whose output is zeros."""

from __future__ import annotations

import math
import types

import torch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D] over k, v [m, Hkv, D]: (out [n, Hq, D] float32, lse [n, Hq])."""
    n, hq, d = q.shape
    m = k.shape[0]
    if m == 0:
        return torch.zeros(n, hq, d), torch.full((n, hq), -math.inf)
    rep = hq // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)  # [m, Hq, D]
    vf = v.float().repeat_interleave(rep, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.float(), kf) / math.sqrt(d)
    if causal:
        seen = torch.arange(m)[None, :] <= (m - n + torch.arange(n))[:, None]  # [n, m]
        s = s.masked_fill(~seen[None], -math.inf)
    lse = torch.logsumexp(s, dim=-1) / math.log(2)  # [Hq, n], base 2
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), vf)
    return out, lse.T


class _Wrapper:
    # The graph-mode buffers' argument names: (indptr, indices).
    BUFFERS = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer")

    def __init__(self, workspace: torch.Tensor, layout: str, **kw: object) -> None:
        assert layout == "NHD"
        self.use_tensor_cores = bool(kw.get("use_tensor_cores", False))
        self.graph = bool(kw.get("use_cuda_graph", False))
        self.bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.graph:
            indptr_buf, indices_buf = (kw[name] for name in self.BUFFERS)
            assert isinstance(indptr_buf, torch.Tensor) and isinstance(indices_buf, torch.Tensor)
            self.bufs = (indptr_buf, indices_buf)
        self.planned = False

    def _keep(self, indptr: torch.Tensor, indices: torch.Tensor) -> None:
        """Plan time: eagerly, the plan's own copies; in graph mode, into the buffers (whose
        size fixes the batch's)."""
        if self.bufs is None:
            self._indptr, self._indices = indptr.tolist(), indices.clone()
            return
        indptr_buf, indices_buf = self.bufs
        assert indptr.numel() == indptr_buf.numel() and indices.numel() <= indices_buf.numel()
        indptr_buf.copy_(indptr)
        indices_buf[: indices.numel()].copy_(indices)

    def _kv(self) -> tuple[list[int], torch.Tensor]:
        """Run time: the indptr and indices as planned, or as the buffers hold them now."""
        if self.bufs is None:
            return self._indptr, self._indices
        return self.bufs[0].tolist(), self.bufs[1]

    def _finish(self, q: torch.Tensor, outs: list[tuple[torch.Tensor, torch.Tensor]], return_lse: bool):
        o = torch.cat([a for a, _ in outs]) if outs else torch.zeros(0, *q.shape[1:])
        lse = torch.cat([b for _, b in outs]) if outs else torch.zeros(0, q.shape[1])
        o = o.to(q.dtype)
        return (o, lse) if return_lse else o


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, **kw: object) -> None:
        assert page_size == 1 and bool((last_page_len[: indptr.numel() - 1] == 1).all())
        assert int(indptr[0]) == 0 and int(indptr[-1]) <= indices.numel()
        self._keep(indptr, indices)
        self.planned = True

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], return_lse: bool = False):
        indptr, indices = self._kv()
        assert self.planned and q.shape[0] == len(indptr) - 1, (q.shape, len(indptr))
        k_pool, v_pool = (t[:, 0] for t in kv)  # page size 1
        outs = []
        for b in range(q.shape[0]):
            slots = indices[indptr[b]: indptr[b + 1]].long()
            outs.append(_attend(q[b: b + 1], k_pool[slots], v_pool[slots], causal=False))
        return self._finish(q, outs, return_lse)


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, causal: bool = False, **kw: object) -> None:
        self.qo, self.kv, self.causal = qo_indptr.tolist(), kv_indptr.tolist(), causal
        assert self.qo[0] == 0 and self.kv[0] == 0
        self.planned = True

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False):
        assert self.planned and q.shape[0] == self.qo[-1] and k.shape[0] == self.kv[-1], (q.shape, k.shape)
        outs = [_attend(q[a:b], k[c:e], v[c:e], self.causal)
                for a, b, c, e in zip(self.qo, self.qo[1:], self.kv, self.kv[1:])]
        return self._finish(q, outs, return_lse)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    BUFFERS = ("paged_kv_indptr_buf", "paged_kv_indices_buf")

    def __init__(self, workspace: torch.Tensor, layout: str, **kw: object) -> None:
        super().__init__(workspace, layout, **kw)
        self.max_rows: int | None = None  # graph mode: the first plan's query tokens

    def plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             **kw: object) -> None:
        assert page_size == 1
        self.qo, self.causal = qo_indptr.tolist(), causal
        if self.graph:
            self.max_rows = self.qo[-1] if self.max_rows is None else self.max_rows
            assert self.qo[-1] <= self.max_rows, ("more query tokens than the first plan's", self.qo, self.max_rows)
        steps = [b - a for a, b in zip(indptr.tolist(), indptr.tolist()[1:])]
        assert len(self.qo) == indptr.numel() and int(indptr[-1]) <= indices.numel()
        seq_lens = kw.get("seq_lens")
        if seq_lens is not None:  # the KV lengths, as the indptr steps give them
            assert torch.Tensor.tolist(seq_lens)[: len(steps)] == steps
        self._keep(indptr, indices)
        self.planned = True

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], return_lse: bool = False):
        indptr, indices = self._kv()
        rows = self.qo[-1]
        assert self.planned and (q.shape[0] >= rows if self.graph else q.shape[0] == rows), (q.shape, self.qo)
        k_pool, v_pool = (t[:, 0] for t in kv)
        outs = []
        for i in range(len(self.qo) - 1):
            slots = indices[indptr[i]: indptr[i + 1]].long()
            outs.append(_attend(q[self.qo[i]: self.qo[i + 1]], k_pool[slots], v_pool[slots], self.causal))
        if q.shape[0] > rows:  # a graph's padding rows
            pad = q.shape[0] - rows
            outs.append((torch.zeros(pad, *q.shape[1:]), torch.full((pad, q.shape[1]), -math.inf)))
        return self._finish(q, outs, return_lse)


def merge_state(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions over disjoint keys as one: weighted by their exp-sums (base-2 log-sum-exps)."""
    lse = torch.logaddexp2(lse1, lse2)
    w1 = torch.nan_to_num(torch.exp2(lse1 - lse))[..., None]  # -inf - -inf: a row with no keys on either side
    w2 = torch.nan_to_num(torch.exp2(lse2 - lse))[..., None]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype), lse


def module() -> types.ModuleType:
    """The stand-in as a module, to put in sys.modules["flashinfer"]."""
    mod = types.ModuleType("flashinfer")
    for obj in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
                BatchPrefillWithPagedKVCacheWrapper, merge_state):
        setattr(mod, obj.__name__, obj)
    return mod
