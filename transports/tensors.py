"""Tensors between processes, without pickle: named tensors packed into one shared
buffer that another process opens (`share_tensors`, `open_shared`: a shared-memory
block on CPU, one CUDA IPC allocation on GPU), and the torch.distributed group a
trainer broadcasts new weights over (`init_update_group`). A trainer uses them through
`sgl.weights`; the engine's weight updates (sgl.sched.runner.weights) open buffers and
join groups with the same functions.

It imports torch, so nothing on the caller's side imports it before a call needs it.
It never touches the default process group (tensor parallelism may use it) and never
unlinks a buffer it did not create."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from sgl.core.protocol import CudaIpcHandle, SharedTensors, TensorEntry

ALIGN = 256  # every entry's offset, in bytes: any dtype's view of it is aligned
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("nccl", "gloo")
_CREATED: set[str] = set()  # shared-memory blocks this process made and has not unlinked


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---- one shared buffer of named tensors ----


class SharedBuffer:
    """Tensors packed by `share_tensors`: `.spec` goes to the engine; the buffer lives
    until `close()` (or the end of a `with` block), which the sender calls once the
    update that reads it has returned."""

    def __init__(self, spec: SharedTensors, shm: SharedMemory | None, cuda: torch.Tensor | None) -> None:
        self.spec = spec
        self._shm = shm
        self._cuda = cuda

    def close(self) -> None:
        """Free the buffer (unlink a shared-memory block); a second call does nothing."""
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.close()
            shm.unlink()
            _CREATED.discard(shm.name)
        self._cuda = None

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_tensors(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> SharedBuffer:
    """Pack the tensors (all on the CPU, or all on one CUDA device) into one buffer: a
    shared-memory block for CPU tensors, one CUDA allocation shared through CUDA IPC for
    CUDA tensors. Names are Hugging Face parameter names; dtypes float32, bfloat16 or
    float16."""
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    if not items:
        raise ValueError("share_tensors needs at least one tensor")
    devices = {t.device for _, t in items}
    device = next(iter(devices))
    if len(devices) > 1 or device.type not in ("cpu", "cuda"):
        raise ValueError(f"share_tensors needs tensors all on the CPU or all on one CUDA device, got "
                         f"{', '.join(sorted(map(str, devices)))}")
    entries: list[TensorEntry] = []
    offset = 0
    for name, t in items:
        if t.dtype not in DTYPES.values():
            raise ValueError(f"tensor {name!r} is {dtype_name(t.dtype)}: share float32, bfloat16 or float16")
        if any(e.name == name for e in entries):
            raise ValueError(f"tensor {name!r} is given twice")
        entries.append(TensorEntry(name, dtype_name(t.dtype), list(t.shape), offset))
        offset = _aligned(offset + t.numel() * t.element_size())
    nbytes = max(offset, ALIGN)
    if device.type == "cpu":
        shm = SharedMemory(create=True, size=nbytes)
        try:
            _pack(torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes), items, entries)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        _CREATED.add(shm.name)
        return SharedBuffer(SharedTensors(entries=entries, nbytes=nbytes, shm_name=shm.name), shm, None)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _pack(buf, items, entries)
    torch.cuda.synchronize(device)  # the receiver reads on its own stream: the copies must be done
    handle = CudaIpcHandle(*buf.untyped_storage()._share_cuda_())
    return SharedBuffer(SharedTensors(entries=entries, nbytes=nbytes, cuda=handle), None, buf)


def _pack(buf: torch.Tensor, items: list[tuple[str, torch.Tensor]], entries: list[TensorEntry]) -> None:
    for (_, t), e in zip(items, entries):
        _view(buf, e).copy_(t.detach())


def _view(buf: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    dtype = DTYPES[e.dtype]
    n = _numel(e.shape) * dtype.itemsize
    return buf[e.offset:e.offset + n].view(dtype).view(e.shape)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_spec(spec: SharedTensors) -> None:
    """ValueError naming the first entry that does not fit `spec`'s buffer (unknown
    dtype, a negative dimension, an unaligned offset, bytes past `nbytes`); reads no data."""
    if (spec.cuda is None) == (not spec.shm_name):
        raise ValueError("tensors: give exactly one of shm_name (a CPU shared-memory block) and cuda (a CUDA buffer)")
    if not spec.entries:
        raise ValueError("tensors: no entries")
    for e in spec.entries:
        if e.dtype not in DTYPES:
            raise ValueError(f"tensor entry {e.name!r}: unknown dtype {e.dtype!r}; use one of {', '.join(DTYPES)}")
        if any(d < 0 for d in e.shape):
            raise ValueError(f"tensor entry {e.name!r}: negative dimension in shape {e.shape}")
        end = e.offset + _numel(e.shape) * DTYPES[e.dtype].itemsize
        if e.offset < 0 or end > spec.nbytes:
            raise ValueError(f"tensor entry {e.name!r}: bytes [{e.offset}, {end}) lie outside the buffer's "
                             f"{spec.nbytes} bytes")
        if e.offset % DTYPES[e.dtype].itemsize:
            raise ValueError(f"tensor entry {e.name!r}: offset {e.offset} is not a multiple of {e.dtype}'s size")


@contextmanager
def open_shared(spec: SharedTensors, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The named tensors of a buffer `share_tensors` made (in any process), as views of
    it, valid inside the block: CPU tensors for a shared-memory block, tensors on the
    sender's CUDA device for a CUDA buffer (`device` must then be a CUDA device). The
    buffer is closed at the end, never unlinked: the sender owns it."""
    check_spec(spec)
    if spec.cuda is not None:
        if device.type != "cuda":
            raise ValueError(f"tensors: a CUDA buffer sent to an engine on {device}: share CPU tensors instead")
        buf = _open_cuda(spec.cuda, spec.nbytes)
        views = [(e.name, _view(buf, e)) for e in spec.entries]
        del buf
        try:
            yield views
        finally:
            views.clear()
        return
    shm = _attach(spec.shm_name)
    try:
        if spec.nbytes > shm.size:
            raise ValueError(f"tensors: nbytes={spec.nbytes} but shared memory {spec.shm_name!r} holds {shm.size}")
        base = torch.frombuffer(shm.buf, dtype=torch.uint8, count=spec.nbytes)
        views = [(e.name, _view(base, e)) for e in spec.entries]
        del base
        try:
            yield views
        except BaseException as exc:
            # The failure's finished frames may hold views, which would keep the block
            # from closing.
            views.clear()
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            views.clear()
    finally:
        shm.close()


def _attach(name: str) -> SharedMemory:
    try:
        if sys.version_info >= (3, 13):
            return SharedMemory(name=name, track=False)
        shm = SharedMemory(name=name)
    except FileNotFoundError:
        raise ValueError(f"tensors: no shared memory named {name!r} (closed by its sender already?)") from None
    # Before 3.13 every opener registers the block with its resource tracker, which would
    # unlink it when this process exits: the sender owns it. A block made in this process
    # stays registered (its creator unregisters it when unlinking).
    if shm.name not in _CREATED:
        resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    return shm


def _open_cuda(h: CudaIpcHandle, nbytes: int) -> torch.Tensor:
    if nbytes > h.size:
        raise ValueError(f"tensors: nbytes={nbytes} but the CUDA buffer holds {h.size}")
    storage = torch.UntypedStorage._new_shared_cuda(
        h.device, h.handle, h.size, h.offset, h.ref_counter_handle, h.ref_counter_offset, h.event_handle,
        h.event_sync_required)
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", h.device)).set_(storage, 0, (h.size,), (1,))


# ---- a group for broadcasting weights ----


class UpdateGroup:
    """One process's membership of a weight-update group: rank 0 (the trainer)
    broadcasts, every engine rank receives. Its own store and process group: the
    default process group is never involved."""

    def __init__(self, name: str, rank: int, world_size: int, backend: str, pg: Any, store: Any) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self._pg = pg
        self._store = store  # the rendezvous' connection; rank 0's serves the others

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Rank `src`'s tensor into every rank's `tensor` (in place), waiting for it."""
        if self._pg is None:
            raise RuntimeError(f"weight update group {self.name!r} is closed")
        self._pg.broadcast(tensor, src).wait()

    def close(self) -> None:
        """Leave the group; a second call does nothing."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            pg.shutdown()

    def __enter__(self) -> UpdateGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def init_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str = "weight_update_group", backend: str = "nccl",
                      timeout_s: float = 60) -> UpdateGroup:
    """Join the group at master_address:master_port as `rank` of `world_size`. Rank 0
    (the trainer) serves the rendezvous; every rank blocks until all have joined, for
    at most `timeout_s`. The engine joins with `init_weights_update_group` at the same time."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port={master_port} is not a TCP port")
    timeout = timedelta(seconds=timeout_s)
    where = f"master_address={master_address!r}, master_port={master_port}"
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
        # Names its keys apart from any other group's rendezvous on the same store.
        prefixed = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            pg: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise ValueError("backend='nccl' needs a CUDA build of torch: use backend='gloo'")
            options = nccl.Options()
            options._timeout = timeout
            pg = nccl(prefixed, rank, world_size, options)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"could not join weight update group {group_name!r} at {where} as rank {rank} of "
                           f"{world_size} within {timeout_s:g} s: {e}") from e
    return UpdateGroup(group_name, rank, world_size, backend, pg, store)
