"""The request-to-token table's device mirror: after any sequence of range writes
and decode writes (one slot per row, or several positions of a row as a speculative
step writes), overlapping and overwriting each other, a sync leaves the mirror equal to
the host table, whether a decode write was the only write since the last sync or not:
a second CPU table, and (marked gpu) a CUDA mirror fed by pinned asynchronous copies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.cache.req_to_token_pool import ReqToTokenPool, gather_kv_indices
from sgl.core.host_copy import Uploads

ROWS, WIDTH = 5, 24

_range_write = st.tuples(st.just("write"), st.integers(0, ROWS - 1), st.integers(0, WIDTH - 1),
                         st.lists(st.integers(1, 999), min_size=0, max_size=8))
_decode_write = st.tuples(st.just("write_at"),
                          st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS, unique=True),
                          st.integers(0, WIDTH - 1), st.integers(1, 999), st.integers(1, 4))
_sync = st.tuples(st.just("sync"))


_DEVICES = [pytest.param("cpu", id="cpu"),
            pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", _DEVICES)
@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(_range_write, _decode_write, _sync), max_size=40))
def test_mirror_equals_host_after_every_sync(device: str, ops: list[tuple]) -> None:
    pool = ReqToTokenPool(ROWS, WIDTH, device)
    for op in ops:
        if op[0] == "write":
            _, row, start, values = op
            values = values[: WIDTH - start]
            pool.write(row, start, torch.tensor(values, dtype=torch.int64))
        elif op[0] == "write_at":  # each row at `per` consecutive positions (wrapping: still distinct cells)
            _, rows, pos, base, per = op
            at = [(row, (pos + i + j) % WIDTH) for i, row in enumerate(rows) for j in range(per)]
            pool.write_at(torch.tensor([r for r, _ in at]), torch.tensor([p for _, p in at], dtype=torch.int64),
                          torch.arange(base, base + len(at), dtype=torch.int64))
        else:
            pool.sync()
            assert torch.equal(pool.mirror.cpu(), pool.req_to_token)
    pool.sync()
    assert torch.equal(pool.mirror.cpu(), pool.req_to_token)
    pool.sync()  # nothing changed: a no-op
    assert torch.equal(pool.mirror.cpu(), pool.req_to_token)


def test_gather_kv_indices_concatenates_row_ranges() -> None:
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    rows, starts, lens = torch.tensor([2, 0, 3]), torch.tensor([1, 0, 7]), torch.tensor([3, 0, 2])
    got = gather_kv_indices(table, rows, starts, lens, 5)
    assert got.tolist() == [21, 22, 23, 37, 38]


_TENSOR = st.tuples(st.sampled_from([torch.int64, torch.int32, torch.float32]),
                    st.lists(st.integers(0, 4), min_size=0, max_size=2))


@pytest.mark.parametrize("device", _DEVICES)
@settings(max_examples=100, deadline=None)
@given(specs=st.lists(_TENSOR, min_size=1, max_size=7), seed=st.integers(0, 2**16))
def test_uploads_give_each_tensor_back_on_the_device(device: str, specs: list[tuple], seed: int) -> None:
    """Uploads: host tensors of mixed dtypes and shapes (empty ones too), sent in one copy
    per dtype, come back equal, in their shape and dtype, on the device, each starting
    16-byte aligned."""
    g = torch.Generator().manual_seed(seed)
    hosts = [(torch.randint(-1000, 1000, tuple(shape), generator=g)).to(dtype) for dtype, shape in specs]
    up = Uploads(torch.device(device))
    places = [up.add(t) for t in hosts]
    up.send()
    for t, i in zip(hosts, places):
        d = up.get(i)
        assert d.device.type == device and d.dtype == t.dtype and d.shape == t.shape
        assert torch.equal(d.cpu(), t)
        assert d.data_ptr() % Uploads.ALIGN_BYTES == 0  # where a tensor of its own would start
