"""sgl's Triton decode attention (kernels/triton_decode.py) against the torch reference
backend, on bf16 and FP8 pools, for the head shapes of the engine's models and a head size
that is not a power of two, rows from one slot to several thousand, and every split count
(marked gpu; skipped without CUDA); and the one-launch gather of a batch's KV slots. Without
a GPU, tests/test_triton_kernels_interpreted.py runs the same kernels in Triton's
interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernel_refs import decode_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(16, 8, 128), (32, 8, 128), (14, 2, 64), (6, 2, 80)])
@pytest.mark.parametrize("splits", [None, 1, 3, 16])
def test_triton_decode_matches_reference(kv: str, hq: int, hkv: int, d: int, splits: int | None) -> None:
    from sgl.kernels.triton_decode import decode_attention

    torch.manual_seed(0)
    rng = random.Random(hq * 1000 + (splits or 0))
    dev, dt = torch.device("cuda"), torch.bfloat16
    kv_dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    slots = 20_000
    k_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt).to(kv_dtype)
    v_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt).to(kv_dtype)
    # One slot, a block's worth and one past it, and long rows cut into many chunks.
    lens = [1, 63, 64, 65, 200, 1000, 5000, *(rng.randint(1, 700) for _ in range(9))]
    indptr = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    indices = (torch.randperm(slots, device=dev)[: sum(lens)] + 1).to(torch.int32)
    q = torch.randn(len(lens), hq, d, device=dev, dtype=dt)
    got = decode_attention(q, k_cache, v_cache, indptr.to(dev), indices, d**-0.5, splits=splits)
    expected = decode_reference(q, k_cache, v_cache, lens, indices, d**-0.5)
    assert got.shape == expected.shape and got.dtype == dt
    err = float((got.float() - expected).norm() / expected.norm())
    assert err < 1e-2, err


def test_triton_decode_replays_in_a_cuda_graph_with_new_lengths() -> None:
    """Captured once at one batch size, replayed with other rows' lengths and slots
    written into the same buffers: the results follow the new inputs."""
    from sgl.kernels.triton_decode import decode_attention

    torch.manual_seed(1)
    dev, dt, hq, hkv, d, b = torch.device("cuda"), torch.bfloat16, 16, 8, 128, 24
    slots = 30_000
    k_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt)
    v_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev)
    indices = torch.zeros(b * 1000, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, device=dev, dtype=dt)
    decode_attention(q, k_cache, v_cache, indptr, indices, d**-0.5)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = decode_attention(q, k_cache, v_cache, indptr, indices, d**-0.5)
    for seed in range(3):
        rng = random.Random(seed)
        lens = [rng.randint(1, 1000) for _ in range(b)]
        host = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        indptr.copy_(host)
        new = (torch.randperm(slots, device=dev)[: sum(lens)] + 1).to(torch.int32)
        indices[: sum(lens)] = new
        q.copy_(torch.randn(b, hq, d, device=dev, dtype=dt))
        g.replay()
        expected = decode_reference(q, k_cache, v_cache, lens, new, d**-0.5)
        assert float((out.float() - expected).norm() / expected.norm()) < 1e-2


@pytest.mark.parametrize("start", [0, 300])
def test_kv_slots_in_one_launch_equal_the_torch_gather_on_a_gpu(start: int) -> None:
    """kernels/kv_indices.py compiled: rows of no slot to several of the kernel's blocks,
    in any order, from column `start` on, equal to the torch ops' gather."""
    from sgl.cache.req_to_token_pool import gather_kv_indices
    from sgl.kernels.kv_indices import gather_rows

    dev = torch.device("cuda")
    lens = [0, 1, 511, 512, 513, 3000, 40]
    table = torch.randint(0, 2**31 - 1, (len(lens) + 5, 4096), dtype=torch.int32, device=dev)
    rows = torch.randperm(len(lens) + 5, device=dev)[: len(lens)]
    indptr = torch.tensor([0, *lens], dtype=torch.int32, device=dev).cumsum(0).to(torch.int32)
    got = gather_rows(table, rows, indptr, sum(lens), start)
    want = gather_kv_indices(table, rows, torch.full_like(rows, start), torch.tensor(lens, device=dev), sum(lens))
    assert torch.equal(got, want)
