"""Attention batches of every shape the backends plan (decode, extend with and without cached
prefixes, mixed batches, cascade decode, mixed batches whose decode rows form a cascade),
built as sched/runner/prepare.py builds their metadata, over distinct slots of a pool. The
CPU tests of the FlashInfer backend (tests/test_flashinfer_backend_cpu.py) and the GPU ones
(tests/test_gpu.py) run the same batches."""

from __future__ import annotations

import random

import torch

from sgl.kernels.attention import AttnMetadata, CascadeMeta

MODES = ["decode", "extend", "extend_prefix", "mixed", "mixed_prefix", "cascade", "mixed_cascade"]


def indptr_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def batch(mode: str, rng: random.Random, slots: int) -> tuple[AttnMetadata, list[int]]:
    """A batch of `mode` over distinct pool slots: its metadata as prepare.py builds it, and
    each query token's slot (its own new token's, where its K/V were written)."""
    if mode == "cascade":
        b, p = rng.randint(2, 5), rng.randint(1, 40)
        own = [rng.randint(1, 20) for _ in range(b)]
        perm = (torch.randperm(slots, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
                [: p + sum(own)] + 1).to(torch.int32)
        shared, rest = perm[:p], perm[p:]
        own_indptr = indptr_of(own)
        full = torch.cat([torch.cat([shared, rest[own_indptr[i]: own_indptr[i + 1]]]) for i in range(b)])
        kv_lens = [p + n for n in own]
        meta = AttnMetadata(True, torch.arange(b + 1, dtype=torch.int32), indptr_of(kv_lens), full[:0], [1] * b,
                            kv_lens, indptr_of(kv_lens), torch.arange(b + 1, dtype=torch.int32), shared_len=p,
                            cascade=CascadeMeta(p, shared, own_indptr, rest))
        return meta, rest[own_indptr[1:] - 1].tolist()
    if mode == "mixed_cascade":
        return mixed_cascade_batch(rng, slots)
    extends = 0 if mode == "decode" else rng.randint(1, 4)
    decodes = rng.randint(1, 4) if mode in ("decode", "mixed", "mixed_prefix") else 0
    prefixed = mode in ("extend_prefix", "mixed_prefix")
    prefix = ([rng.randint(0, 30) if prefixed else 0 for _ in range(extends)]
              + [rng.randint(0, 40) for _ in range(decodes)])
    if prefixed and not any(prefix[:extends]):
        prefix[0] = 1
    new = [rng.randint(1, 25) for _ in range(extends)] + [1] * decodes
    kv_lens = [a + n for a, n in zip(prefix, new)]
    perm = (torch.randperm(slots, generator=torch.Generator().manual_seed(rng.randrange(2**31)))[: sum(kv_lens)]
            + 1).to(torch.int32)
    kv_indptr = indptr_of(kv_lens)
    rows = [perm[kv_indptr[i]: kv_indptr[i + 1]] for i in range(len(kv_lens))]
    meta = AttnMetadata(mode == "decode", indptr_of(new), kv_indptr, perm, new, kv_lens, kv_indptr, indptr_of(new),
                        decode_from=extends if mode.startswith("mixed") else None)
    if prefixed:
        meta.prefix_indptr_host = indptr_of(prefix[:extends])
        meta.prefix_lens_host = torch.tensor(prefix[:extends], dtype=torch.int32)
        meta.prefix_indices = torch.cat([r[: prefix[i]] for i, r in enumerate(rows[:extends])])
    new_slots = [s for i, r in enumerate(rows) for s in r[prefix[i]:].tolist()]
    return meta, new_slots


def mixed_cascade_batch(rng: random.Random, slots: int) -> tuple[AttnMetadata, list[int]]:
    """Prompt chunks (with cached prefixes or not), then decode rows that begin with the
    same slots: every row's KV in kv_indices, and the decode rows' split in `cascade`."""
    extends, decodes, p = rng.randint(1, 3), rng.randint(2, 4), rng.randint(1, 40)
    prefix = [rng.choice([0, rng.randint(1, 20)]) for _ in range(extends)]
    new = [rng.randint(1, 25) for _ in range(extends)]
    own = [rng.randint(1, 20) for _ in range(decodes)]
    perm = (torch.randperm(slots, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
            [: sum(prefix) + sum(new) + p + sum(own)] + 1).to(torch.int32)
    ext_lens = [a + n for a, n in zip(prefix, new)]
    ext_slots, shared, rest = perm[: sum(ext_lens)], perm[sum(ext_lens): sum(ext_lens) + p], perm[sum(ext_lens) + p:]
    ext_indptr, own_indptr = indptr_of(ext_lens), indptr_of(own)
    ext_rows = [ext_slots[ext_indptr[i]: ext_indptr[i + 1]] for i in range(extends)]
    dec_rows = [torch.cat([shared, rest[own_indptr[i]: own_indptr[i + 1]]]) for i in range(decodes)]
    kv_lens = ext_lens + [p + n for n in own]
    qo = new + [1] * decodes
    meta = AttnMetadata(False, indptr_of(qo), indptr_of(kv_lens), torch.cat(ext_rows + dec_rows), qo, kv_lens,
                        indptr_of(kv_lens), indptr_of(qo), decode_from=extends,
                        cascade=CascadeMeta(p, shared, own_indptr, rest))
    if any(prefix):
        meta.prefix_indptr_host = indptr_of(prefix)
        meta.prefix_lens_host = torch.tensor(prefix, dtype=torch.int32)
        meta.prefix_indices = torch.cat([r[: prefix[i]] for i, r in enumerate(ext_rows)])
    new_slots = [s for i, r in enumerate(ext_rows) for s in r[prefix[i]:].tolist()] + [int(r[-1]) for r in dec_rows]
    return meta, new_slots


def on_device(meta: AttnMetadata, dev: torch.device) -> AttnMetadata:
    """The metadata as prepare.py hands it to a GPU backend: its device tensors on `dev`,
    its host ones pinned."""
    pin = (lambda t: t.pin_memory()) if dev.type == "cuda" else (lambda t: t)
    meta.qo_indptr, meta.kv_indptr, meta.kv_indices = (t.to(dev) for t in (meta.qo_indptr, meta.kv_indptr,
                                                                             meta.kv_indices))
    meta.kv_indptr_host, meta.qo_indptr_host = pin(meta.kv_indptr_host), pin(meta.qo_indptr_host)
    if meta.prefix_indices is not None:
        meta.prefix_indices = meta.prefix_indices.to(dev)
        meta.prefix_indptr_host = pin(meta.prefix_indptr_host)
        meta.prefix_lens_host = None if meta.prefix_lens_host is None else pin(meta.prefix_lens_host)
    if (c := meta.cascade) is not None:
        c.shared_indices, c.suffix_indices = c.shared_indices.to(dev), c.suffix_indices.to(dev)
        c.suffix_indptr_host = pin(c.suffix_indptr_host)
    return meta
