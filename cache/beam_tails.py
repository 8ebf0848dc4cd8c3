"""KV slots of beams' generated tokens, shared by the beams that descend from one
another: a beam that forks hands its slots to every child by reference (their
request rows point at the same slots), and a slot is freed when the last beam
through it is gone.

Per slot s: `ref[s]`, how many children continue from s (a slot written after it,
or a beam whose next slot will follow it), and `up[s]`, the slot before s on its
beam (0 before the first generated token). Each beam step registers the slots it
wrote with their children counts; a slot with none is freed, which takes one child
from the slot before it, and so on up. The prompt's slots are not here: the request
owns them (and the radix tree shares them) as any request's.

It tracks ownership only: it never allocates, and never touches the request table
or KV tensors."""

from __future__ import annotations

import torch

from .kv_allocator import TokenToKVPoolAllocator


class BeamTails:
    def __init__(self, allocator: TokenToKVPoolAllocator) -> None:
        self.allocator = allocator
        n = allocator.size + 1
        self.ref = torch.zeros(n, dtype=torch.int32)
        self.up = torch.zeros(n, dtype=torch.int64)

    def step(self, written: torch.Tensor, before: torch.Tensor, children: torch.Tensor) -> int:
        """One beam step wrote slot written[i] after before[i] (0: the beam's first
        generated token), and children[i] beams continue from it. Frees the slots no
        beam continues from; returns how many."""
        written = written.to("cpu", torch.int64)
        self.up[written] = before.to("cpu", torch.int64)
        counts = children.to("cpu", torch.int32)
        self.ref[written] = counts
        dead = written[counts == 0]
        freed = 0
        while dead.numel():
            self.allocator.free(dead)
            freed += int(dead.numel())
            parents = self.up[dead]
            parents = parents[parents > 0]
            if not parents.numel():
                break
            self.ref.index_add_(0, parents, torch.full_like(parents, -1, dtype=torch.int32))
            parents = parents.unique()
            dead = parents[self.ref[parents] <= 0]
        return freed
