"""Tensor parallelism's process group, as the model and the scheduler see it.

One `TPGroup` per scheduler process: its rank, the group's size and torch.distributed's
process groups (gloo on CPU, NCCL on GPU for tensors; always a gloo group for the
scheduler's Python objects). A group of size 1 is the single-process engine: every
collective is then the identity and nothing touches torch.distributed, so the model
code has one path. This module only wraps torch.distributed's collectives; it never
starts processes and never decides what is sharded (the model does)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# A follower waits in a broadcast for rank 0 while the engine is idle: far longer than any
# idle period would be wrong (a dead peer is seen by the connection's close, not this).
OBJECT_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the tensor collectives' group (NCCL on GPU, gloo on CPU); None alone
    cpu_group: Any = None  # gloo, for Python objects; None alone

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [lo, hi) of n items split in `size` equal parts (n must divide)."""
        if n % self.size:
            raise ValueError(f"{n} does not split over tp_size={self.size}: it must be a multiple of it")
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (every rank receives the same bytes)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (queued on the device's stream under NCCL)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x joined along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the others pass anything, e.g. None)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def close(self) -> None:
        """Leave the group (the process's last collective)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def min_int(self, n: int) -> int:
        """The smallest of every rank's n (e.g. KV slots, so that all ranks agree)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank's part of a call succeeded (each rank asks once, in step)."""
        return self.min_int(int(ok)) == 1


def init_tp(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the group of `size` scheduler processes at `init_method` (tcp://host:port)."""
    if size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The model's collectives keep torch's default timeout: every rank runs them in step, so
    # one that waits that long means a rank is lost.
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    # Objects get a group of their own even on CPU: the overlap loop's forward thread runs
    # the model's collectives while the loop broadcasts its input, and two threads must
    # never share one group (their calls could pair up across ranks in different orders).
    cpu_group = dist.new_group(backend="gloo", timeout=OBJECT_TIMEOUT)
    return TPGroup(rank, size, dist.group.WORLD, cpu_group)
