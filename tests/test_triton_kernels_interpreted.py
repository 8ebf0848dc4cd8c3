"""sgl's Triton kernels run by Triton's interpreter on the CPU (TRITON_INTERPRET=1), so
CI, which has no GPU, checks their indexing: the decode kernel's chunks, masks and
head-group padding for any lengths, split counts and head shapes, the KV slots gathered
in one launch, and the fused norm + rotary + KV write for head sizes that are and are not
powers of two, against the torch reference path, and the FP8 weight-only product's tiles.
Interpreted, products run in numpy at full precision; the GPU tests
(tests/test_gpu_triton_decode.py, tests/test_gpu.py) check the compiled kernels, FP8 pools
included (numpy has no FP8)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import PROFILE
from tests.kernel_refs import decode_reference, norm_rope_reference

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton's interpreter is on only without a GPU (tests/conftest.py)")


@settings(PROFILE, max_examples=12)
@given(heads=st.sampled_from([(4, 2), (6, 2), (2, 2), (8, 1)]), d=st.sampled_from([16, 32, 48]),
       lens=st.lists(st.integers(1, 300), min_size=1, max_size=4), splits=st.none() | st.integers(1, 16),
       seed=st.integers(0, 2**16))
def test_decode_kernel_matches_the_reference(heads: tuple[int, int], d: int, lens: list[int], splits: int | None,
                                             seed: int) -> None:
    from sgl.kernels.triton_decode import decode_attention

    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 50
    k = torch.randn(slots + 1, hkv, d, generator=g)
    v = torch.randn(slots + 1, hkv, d, generator=g)
    q = torch.randn(len(lens), hq, d, generator=g)
    indices = (torch.randperm(slots, generator=g)[: sum(lens)] + 1).to(torch.int32)
    indptr = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    got = decode_attention(q, k, v, indptr, indices, d**-0.5, splits=splits, block_n=32)
    expected = decode_reference(q, k, v, lens, indices, d**-0.5)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4), (got - expected).abs().max()


@settings(PROFILE, max_examples=15)
@given(lens=st.lists(st.integers(0, 1200), min_size=1, max_size=6), start=st.integers(0, 90),
       seed=st.integers(0, 2**16))
def test_kv_slots_in_one_launch_equal_the_torch_gather(lens: list[int], start: int, seed: int) -> None:
    """Each row's n slots from column `start` on (0: a forward's; P: a cascade's own slots
    past its shared prefix), rows in any order, lengths from none to past one iteration of
    the kernel's block: equal to the torch ops' gather."""
    from sgl.cache.req_to_token_pool import gather_kv_indices
    from sgl.kernels.kv_indices import gather_rows

    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 2**31 - 1, (len(lens) + 3, 1300), generator=g, dtype=torch.int32)
    rows = torch.randperm(len(lens) + 3, generator=g)[: len(lens)]
    indptr = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    got = gather_rows(table, rows, indptr, sum(lens), start)
    want = gather_kv_indices(table, rows, torch.full_like(rows, start), torch.tensor(lens), sum(lens))
    assert got.dtype == torch.int32 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d", "norm"), [(4, 2, 64, True), (6, 2, 80, True), (2, 1, 16, False),
                                                      (8, 8, 128, True)])
def test_norm_rope_store_matches_the_reference(hq: int, hkv: int, d: int, norm: bool, dtype: torch.dtype) -> None:
    """Against the torch path in float32 (norms, rotary, the indexed write): q and k
    within one rounding of `dtype`, the pool holding exactly the returned k and v, no
    other slot written."""
    from sgl.cache.kv_write import write_kv
    from sgl.kernels.layers import rope_tables
    from sgl.kernels.norm_rope_store import norm_rope_store

    g = torch.Generator().manual_seed(hq * d)
    t = 9
    rope = rope_tables(d, 4096, 1e6, None, "cpu")
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    qw = (torch.rand(d, generator=g) + 0.5).to(dtype) if norm else None
    kw = (torch.rand(d, generator=g) + 0.5).to(dtype) if norm else None
    pos = torch.randint(0, 4000, (t,), generator=g)
    loc = torch.randperm(2 * t, generator=g)[:t] + 1
    k_buf = torch.randn(2 * t + 1, hkv, d, generator=g).to(dtype)
    v_buf = torch.randn(2 * t + 1, hkv, d, generator=g).to(dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    q0, k0, v0 = norm_rope_reference(qkv, hq, hkv, d, qw, kw, 1e-6, pos, rope)
    q, k, v = norm_rope_store(qkv, hq, hkv, d, qw, kw, 1e-6, pos, rope.cos_sin, k_buf, v_buf, loc)
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    for got, want in ((q, q0), (k, k0)):
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.allclose(got.float(), want, rtol=tol, atol=tol), (got.float() - want).abs().max()
    assert torch.equal(v.float(), v0)
    write_kv(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


@settings(PROFILE, max_examples=12)
@given(m=st.integers(1, 64), k=st.integers(1, 300), n=st.integers(1, 80), blocks=st.sampled_from([(16, 16), (32, 64)]),
       split_k=st.sampled_from([1, 2, 3, 8]), seed=st.integers(0, 2**16))
def test_weight_only_product_matches_the_dequantized_product(m: int, k: int, n: int, blocks: tuple[int, int],
                                                              split_k: int, seed: int) -> None:
    """The FP8 weight-only product's tiles, masks and per-channel scales, for shapes on and
    off its blocks (a float16 weight stands in for FP8, which numpy lacks), whole or with K
    split over programs (splits left without any K among them), against the product in
    float64; more rows than a tile holds are refused."""
    from sgl.kernels.fp8_linear import WEIGHT_ONLY_MAX_M, weight_only_linear

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.float16)
    scale = torch.rand(n, 1, generator=g) + 0.5
    got = weight_only_linear(x, w, scale, block_n=blocks[0], block_k=blocks[1], split_k=split_k)
    want = x.double() @ (w.double() * scale.double()).T
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5), (got.double() - want).abs().max()
    with pytest.raises(ValueError, match="at most"):
        weight_only_linear(torch.zeros(WEIGHT_ONLY_MAX_M + 1, k), w, scale)


@settings(PROFILE, max_examples=15)
@given(v=st.integers(1, 200), rows=st.lists(st.tuples(st.booleans(), st.integers(0, 2**16)), min_size=1, max_size=4),
       lanes=st.sampled_from([4, 8, 32]), tiles=st.integers(1, 2))
def test_gumbel_draw_greedy_rows_are_argmax_and_masked_ids_never_drawn(
        v: int, rows: list[tuple[bool, int]], lanes: int, tiles: int) -> None:
    """The one-pass draw (kernels/gumbel_draw.py), cut into many small chunks: a greedy
    row gets torch.argmax's id exactly (ties included: few distinct values), a sampled
    row an id whose logit is finite (a grammar's -inf mask is never drawn), bf16 rows as
    float32 ones; the offset moves on by what the draw used."""
    from sgl.kernels.gumbel_draw import gumbel_draw

    logits = torch.empty(len(rows), v)
    for i, (_, seed) in enumerate(rows):
        g = torch.Generator().manual_seed(seed)
        logits[i] = torch.randint(-2, 3, (v,), generator=g).float()
        logits[i, torch.rand(v, generator=g) < 0.5] = float("-inf")
        logits[i, torch.randint(0, v, (1,), generator=g)] = 1.0  # one finite id at least
    greedy = torch.tensor([gr for gr, _ in rows])
    offset = torch.tensor([5], dtype=torch.int64)
    for dtype in (torch.float32, torch.bfloat16):
        ids = gumbel_draw(logits.to(dtype), torch.full((len(rows), 1), 0.8), greedy, torch.tensor([7]), offset,
                          lanes=lanes, tiles=tiles)
        assert ids.dtype == torch.int64 and ids.shape == (len(rows),)
        argmax = logits.argmax(dim=-1)
        for i, (gr, _) in enumerate(rows):
            assert ids[i] == argmax[i] if gr else bool(torch.isfinite(logits[i, ids[i]]))
    chunk = 4 * lanes * tiles
    assert int(offset) == 5 + 2 * 4 * len(rows) * (-(-v // chunk) * chunk // 4)  # uniforms, 4 a counter


def test_gumbel_draw_samples_softmax_of_logits_over_temperature() -> None:
    """200 draws of one 8-id distribution at T = 0.5 (one chunk a row: the property above cuts
    rows into many) against
    softmax(logits / T), within 5 standard errors each (T = 1 would put the first id 6.3
    off); the same seed and offset draw the same ids, the next draw others. The GPU
    test (tests/test_gpu.py) takes 20,000 draws."""
    from sgl.kernels.gumbel_draw import gumbel_draw

    draws, t = 200, 0.5
    base = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    logits = torch.full((draws, 12), float("-inf"))
    logits[:, 2:10] = base
    seed, offset = torch.tensor([11]), torch.zeros(1, dtype=torch.int64)
    ids = gumbel_draw(logits, torch.full((draws,), t), None, seed, offset, lanes=4, tiles=1)
    few = torch.full((40,), t)
    assert torch.equal(gumbel_draw(logits[:40], few, None, seed, torch.zeros(1, dtype=torch.int64), lanes=4, tiles=1),
                       ids[:40])  # a row's noise depends on its index and the offset, not on the batch size
    assert not torch.equal(gumbel_draw(logits[:40], few, None, seed, offset, lanes=4, tiles=1), ids[:40])
    want = torch.softmax(base.double() / t, -1)
    got = torch.bincount(ids, minlength=12).double() / draws
    assert got[:2].sum() == 0 and got[10:].sum() == 0
    se = (want * (1 - want) / draws).sqrt()
    assert bool(((got[2:10] - want).abs() <= 5 * se).all()), (got, want)


@settings(PROFILE, max_examples=12)
@given(v=st.integers(40, 160), width_cut=st.integers(0, 30), rows=st.lists(
    st.tuples(st.booleans(), st.sampled_from([None, 0, 1, 2])), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_gumbel_draw_applies_an_xgrammar_bitmask(v: int, width_cut: int, rows: list[tuple[bool, int | None]],
                                                 seed: int) -> None:
    """A grammar's bitmask applied in the draw's read equals xgrammar's own apply
    followed by the engine's cut at the tokenizer's width: a greedy masked row gets the
    argmax of the logits masked so, a sampled one an id they allow; a row with no mask
    row (-1) is not masked."""
    import xgrammar

    from sgl.kernels.gumbel_draw import Bitmask, gumbel_draw

    g = torch.Generator().manual_seed(seed)
    width = v - width_cut
    words = torch.randint(-(2**31), 2**31, (3, (width + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(len(rows), v, generator=g)
    which = torch.tensor([-1 if m is None else m for _, m in rows], dtype=torch.int32)
    expected = logits.clone()
    for i, (_, m) in enumerate(rows):
        if m is not None:
            row = expected[i : i + 1, :width].clone()
            xgrammar.apply_token_bitmask_inplace(row, words[m : m + 1].clone(), vocab_size=width)
            expected[i, :width] = row[0]
            expected[i, width:] = float("-inf")
    greedy = torch.tensor([gr for gr, _ in rows])
    ids = gumbel_draw(logits, torch.ones(len(rows)), greedy, torch.tensor([1]), torch.zeros(1, dtype=torch.int64),
                      Bitmask(words, which, width), lanes=4, tiles=2)
    for i, (gr, m) in enumerate(rows):
        if not torch.isfinite(expected[i]).any():
            continue  # a mask that allows nothing (never a grammar's): any id
        assert ids[i] == expected[i].argmax() if gr else bool(torch.isfinite(expected[i, ids[i]]))
        if m is None:
            assert torch.equal(expected[i], logits[i])


def test_gumbel_draw_bitmask_rows_none_is_row_i_takes_mask_row_i() -> None:
    """Every row masked by its own mask row (Bitmask.rows None, the engine's case when
    every sampled row has a grammar) draws exactly what the explicit index 0..B-1 draws."""
    from sgl.kernels.gumbel_draw import Bitmask, gumbel_draw

    g = torch.Generator().manual_seed(3)
    b, v, width = 5, 150, 131
    logits = torch.randn(b, v, generator=g)
    words = torch.randint(-(2**31), 2**31, (b, (width + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    greedy = torch.tensor([True, False, True, False, False])
    draws = [gumbel_draw(logits, torch.full((b,), 0.7), greedy, torch.tensor([2]), torch.zeros(1, dtype=torch.int64),
                         Bitmask(words, rows, width), lanes=4, tiles=2)
             for rows in (None, torch.arange(b, dtype=torch.int32))]
    assert torch.equal(draws[0], draws[1])
    assert bool((draws[0] < width).all())
