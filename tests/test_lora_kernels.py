"""The multi-LoRA GEMMs (kernels/lora.py): LoraBatch's blocks from a packed batch's
requests (exact cover of the rows with an adapter, one slot a block, runs merged, the
max_blocks bound, CUDA-graph buffers padded), and lora_apply against a per-row float64
loop, on the torch path and on the Triton path.

On a machine without a GPU, tests/conftest.py turns on Triton's interpreter, which runs
the Triton path on the CPU in numpy: float32 (exact products) and float16 are checked
there. bfloat16 is not: the interpreter's tl.dot over bf16 returns garbage (numpy has no
bfloat16; triton 3.9), so bf16 is checked by the GPU test at the end (marked gpu), which
also replays the kernels from a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.kernels.lora import BLOCK_M, LoraBatch, expand_block_n, lora_apply
from tests.hypothesis_profiles import PROFILE

CPU = torch.device("cpu")
requests = st.lists(st.tuples(st.integers(-1, 3), st.integers(0, 40)), min_size=0, max_size=12)


def row_slots(slots: list[int], lens: list[int]) -> list[int]:
    return [s for s, k in zip(slots, lens) for _ in range(k)]


def blocks_of(batch: LoraBatch) -> list[tuple[int, int, int]]:
    return list(zip(batch.block_start.tolist(), batch.block_len.tolist(), batch.block_slot.tolist()))


@settings(PROFILE, max_examples=300)
@given(reqs=requests)
def test_blocks_cover_exactly_the_adapter_rows_one_slot_each(reqs: list[tuple[int, int]]) -> None:
    slots, lens = [s for s, _ in reqs], [k for _, k in reqs]
    per_row = row_slots(slots, lens)
    batch = LoraBatch.from_runs(slots, lens, CPU, triton=False)
    rows = batch.rows.tolist()
    covered: list[int] = []
    for start, n, slot in blocks_of(batch):
        assert 1 <= n <= BLOCK_M and slot >= 0
        assert [per_row[t] for t in rows[start : start + n]] == [slot] * n
        covered += rows[start : start + n]
    assert covered == rows  # the blocks, in order, are the rows: every adapter row once, no other
    assert sorted(rows) == [t for t, s in enumerate(per_row) if s >= 0]
    # Grouped by slot, row order kept within one: each slot's rows are ceil(L / BLOCK_M) blocks.
    by_slot = {s: [t for t, x in enumerate(per_row) if x == s] for s in set(per_row) if s >= 0}
    assert rows == [t for s in sorted(by_slot) for t in by_slot[s]]
    want = sum(-(-len(r) // BLOCK_M) for r in by_slot.values())
    assert batch.block_len.shape[0] == want <= LoraBatch.max_blocks(len(per_row), len(reqs))
    assert batch.block_start.dtype == batch.block_len.dtype == batch.block_slot.dtype == batch.rows.dtype == torch.int32
    # Each field 16-byte aligned in the one packed tensor, as Triton's kernels were compiled for.
    assert all(t.storage_offset() % 4 == 0 for t in (batch.block_start, batch.block_len, batch.block_slot, batch.rows))
    groups = {slot: r.tolist() for slot, r in batch.groups}
    assert len(groups) == len(batch.groups)
    assert groups == by_slot
    assert all(r.dtype == torch.int64 for _, r in batch.groups)
    assert LoraBatch.from_runs(slots, lens, CPU, triton=True).groups == []


@pytest.mark.parametrize(("rows", "reqs"), [(0, 0), (1, 1), (16, 1), (17, 1), (40, 3), (512, 512), (8192, 7)])
def test_max_blocks_is_reached(rows: int, reqs: int) -> None:
    """reqs - 1 one-row requests of distinct slots, then one of the remaining rows."""
    if reqs == 0:
        assert LoraBatch.max_blocks(rows, reqs) == 0
        return
    lens = [1] * (reqs - 1) + [rows - reqs + 1]
    batch = LoraBatch.from_runs(list(range(reqs)), lens, CPU, triton=True)
    assert batch.block_len.shape[0] == LoraBatch.max_blocks(rows, reqs)


def test_a_decode_batch_taking_turns_between_adapters_makes_few_blocks() -> None:
    batch = LoraBatch.from_runs([i % 8 for i in range(256)], [1] * 256, CPU, triton=True)
    assert batch.block_len.tolist() == [16, 16] * 8 and batch.rows.tolist()[:3] == [0, 8, 16]


def test_copy_into_fills_the_fixed_buffers_and_pads_with_empty_blocks() -> None:
    cap = LoraBatch.max_blocks(60, 6)
    dst = LoraBatch.buffers(cap, 60, CPU)
    assert dst.triton and blocks_of(dst) == [(0, 0, -1)] * cap
    big = LoraBatch.from_runs([0, 1, 0, 1, 0, 1], [10] * 6, CPU, triton=True)
    small = LoraBatch.from_runs([2, -1], [20, 40], CPU, triton=True)
    big.copy_into(dst)
    assert blocks_of(dst)[: len(blocks_of(big))] == blocks_of(big)
    assert dst.rows.tolist() == big.rows.tolist()
    small.copy_into(dst)
    nb = len(blocks_of(small))
    assert blocks_of(dst)[:nb] == blocks_of(small) == [(0, 16, 2), (16, 4, 2)]
    assert dst.rows[:20].tolist() == list(range(20))
    assert dst.block_len[nb:].tolist() == [0] * (cap - nb)


def test_expand_block_n() -> None:
    assert expand_block_n((2048, 1024, 1024), 16) == 128
    assert expand_block_n((3072, 3072), 16) == 128
    assert expand_block_n((64, 32, 32), 16) == 32
    assert expand_block_n((4096,), 256) == 64  # the b tile bound: 64 columns x 256 ranks
    assert expand_block_n((40, 24, 24), 16) == 128  # no power of two from 16 divides: programs straddle parts


def weights(subs: tuple[int, ...], k: int, r: int, ranks: list[int], dtype: torch.dtype,
            g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """a [S, n_sub*R, K] and b [S, N, R] for adapters of the given true ranks, zero past them."""
    n_sub, n = len(subs), sum(subs)
    a = torch.randn(len(ranks), n_sub * r, k, generator=g) / k**0.5
    b = torch.randn(len(ranks), n, r, generator=g) / r**0.5
    for s, rank in enumerate(ranks):
        a[s].view(n_sub, r, k)[:, rank:] = 0
        b[s, :, rank:] = 0
    return a.to(dtype), b.to(dtype)


def reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, subs: tuple[int, ...],
              per_row: list[int]) -> torch.Tensor:
    """y plus each adapter row's delta, a row and a part at a time, in float64."""
    out = y.double().clone()
    r = b.shape[2]
    offs = [sum(subs[:j]) for j in range(len(subs) + 1)]
    for t, s in enumerate(per_row):
        if s < 0:
            continue
        for j in range(len(subs)):
            inter = x[t].double() @ a[s, j * r : (j + 1) * r].double().T
            out[t, offs[j] : offs[j + 1]] += inter @ b[s, offs[j] : offs[j + 1]].double().T
    return out


def check(batch: LoraBatch, reqs: list[tuple[int, int]], subs: tuple[int, ...], k: int, r: int, ranks: list[int],
          seed: int, dtype: torch.dtype = torch.float32, per_row: list[int] | None = None) -> None:
    """lora_apply over `batch` equals the reference; the rows without an adapter keep their bits."""
    g = torch.Generator().manual_seed(seed)
    slots, lens = [s for s, _ in reqs], [n for _, n in reqs]
    per_row = row_slots(slots, lens) if per_row is None else per_row
    a, b = weights(subs, k, r, ranks, dtype, g)
    x = torch.randn(len(per_row), k, generator=g).to(dtype)
    y0 = torch.randn(len(per_row), sum(subs), generator=g).to(dtype)
    y = y0.clone()
    lora_apply(x, y, a, b, subs, batch)
    want = reference(x, y0, a, b, subs, per_row)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), want, atol=tol, rtol=tol), (y.double() - want).abs().max()
    base = torch.tensor([s < 0 for s in per_row], dtype=torch.bool)
    assert torch.equal(y[base], y0[base])


SUBS = [(48,), (40, 24), (32, 16, 24), (64, 32, 32)]
adapters = st.lists(st.tuples(st.integers(-1, 2), st.integers(0, 37)), min_size=1, max_size=8)


@settings(PROFILE, max_examples=40)
@given(reqs=adapters, subs=st.sampled_from(SUBS), r=st.sampled_from([8, 16, 32]), k=st.sampled_from([24, 64]),
       seed=st.integers(0, 2**16))
def test_torch_path_matches_the_reference(reqs: list[tuple[int, int]], subs: tuple[int, ...], r: int, k: int,
                                          seed: int) -> None:
    ranks = [r, max(1, r // 2), 3]  # slot 0 at full rank, the others padded with zeros
    batch = LoraBatch.from_runs([s for s, _ in reqs], [n for _, n in reqs], CPU, triton=False)
    check(batch, reqs, subs, k, r, ranks, seed)


interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter is on only without a GPU (tests/conftest.py)")


@interpreted
@settings(PROFILE, max_examples=20)
@given(reqs=adapters, subs=st.sampled_from(SUBS), r=st.sampled_from([8, 16, 32]), k=st.sampled_from([24, 160]),
       seed=st.integers(0, 2**16))
def test_triton_path_matches_the_reference_interpreted(reqs: list[tuple[int, int]], subs: tuple[int, ...], r: int,
                                                       k: int, seed: int) -> None:
    """float32; K = 24 (one masked step), 160 (a whole step of 128, then a masked one); parts
    that BLOCK_N divides and parts it straddles; rank 8 padded to tl.dot's 16."""
    pytest.importorskip("triton")
    batch = LoraBatch.from_runs([s for s, _ in reqs], [n for _, n in reqs], CPU, triton=True)
    check(batch, reqs, subs, 160 if k == 160 else k, r, [r, max(1, r // 2), 3], seed)


@interpreted
def test_triton_path_skips_padding_and_base_blocks_interpreted() -> None:
    """Graph buffers of more blocks than the batch has (padding blocks of len 0), and
    explicit blocks of slot -1 over base rows: neither writes anything."""
    pytest.importorskip("triton")
    reqs = [(1, 20), (-1, 9), (0, 3), (2, 1), (-1, 16)]
    slots, lens = [s for s, _ in reqs], [n for _, n in reqs]
    dst = LoraBatch.buffers(LoraBatch.max_blocks(sum(lens), len(reqs)), sum(lens), CPU)
    dst.block_start.fill_(5)  # padding blocks that would overwrite real rows if they ran
    dst.block_slot.fill_(0)
    LoraBatch.from_runs(slots, lens, CPU, triton=True).copy_into(dst)
    check(dst, reqs, (40, 24, 24), 64, 16, [16, 8, 4], seed=1)
    blocks = LoraBatch.from_runs(slots, lens, CPU, triton=True)
    with_base = LoraBatch(torch.cat([blocks.block_start, torch.tensor([0, 5], dtype=torch.int32)]),
                          torch.cat([blocks.block_len, torch.tensor([9, 16], dtype=torch.int32)]),
                          torch.cat([blocks.block_slot, torch.tensor([-1, -1], dtype=torch.int32)]), blocks.rows, [],
                          True)
    check(with_base, reqs, (48,), 64, 16, [16, 8, 4], seed=2)


@interpreted
def test_triton_path_float16_interpreted() -> None:
    pytest.importorskip("triton")
    reqs = [(0, 17), (1, 3), (-1, 4), (0, 1)]
    batch = LoraBatch.from_runs([s for s, _ in reqs], [n for _, n in reqs], CPU, triton=True)
    check(batch, reqs, (32, 16, 16), 64, 16, [16, 8], seed=3, dtype=torch.float16)


COMPILE_FOR_H200 = """
import sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from sgl.kernels.lora import kernels, launch_settings

k, subs, r = int(sys.argv[1]), tuple(int(v) for v in sys.argv[2].split(",")), int(sys.argv[3])
dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[4]]
shrink, expand = kernels()
cs, ce = launch_settings(k, subs, r, dt)
ptrs = {"start_ptr": "*i32", "len_ptr": "*i32", "slot_ptr": "*i32", "rows_ptr": "*i32"}
for fn, ins, stride, c in ((shrink, {"x_ptr": sys.argv[4], "a_ptr": sys.argv[4], "inter_ptr": "fp32"}, "stride_x", cs),
                           (expand, {"inter_ptr": "fp32", "b_ptr": sys.argv[4], "y_ptr": sys.argv[4]}, "stride_y", ce)):
    opts = {"num_warps": c.pop("num_warps"), "num_stages": c.pop("num_stages")}
    sig = {**{p: "*" + t for p, t in ins.items()}, **ptrs, stride: "i32", **{name: "constexpr" for name in c}}
    out = compile(ASTSource(fn, sig, c), target=GPUTarget("cuda", 90, 32), options=opts)
    assert "mma" in out.asm["ptx"] and out.asm["cubin"]
"""


@pytest.mark.slow
@pytest.mark.parametrize(("k", "subs", "r", "dtype"), [(1024, "2048,1024,1024", 16, "bf16"), (3072, "1024", 16, "bf16"),
                                                      (1024, "3072,3072", 256, "bf16"), (72, "40,24,24", 8, "fp16")])
def test_triton_kernels_compile_for_an_h200(k: int, subs: str, r: int, dtype: str) -> None:
    """Lowered to sm_90 machine code on the CPU (no GPU needed, interpreter off): what the
    interpreter cannot check, the kernels' compiled semantics (constexpr branches, tl.dot
    shapes and precisions), at Qwen3-0.6B's qkv and down, rank 256 and straddling parts."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H200, str(k), subs, str(r), dtype], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("subs", [(2048, 1024, 1024), (1024,), (3072, 3072), (40, 24, 24)])
def test_triton_path_bf16_on_gpu_and_in_a_cuda_graph(subs: tuple[int, ...]) -> None:
    """The compiled kernels in bf16, eager and replayed from a CUDA graph over fixed
    buffers, against the float64 reference (within bf16 rounding of y)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(0)
    k, r, ranks = 1024, 16, [16, 8, 16, 4]
    reqs = [(int(s), n) for s, n in zip(torch.randint(-1, 4, (40,), generator=g), torch.randint(1, 40, (40,),
                                                                                                 generator=g))]
    slots, lens = [s for s, _ in reqs], [n for _, n in reqs]
    per_row = row_slots(slots, lens)
    a, b = weights(subs, k, r, ranks, dt, g)
    x = torch.randn(len(per_row), k, generator=g).to(dt)
    y0 = torch.randn(len(per_row), sum(subs), generator=g).to(dt)
    want = reference(x, y0, a, b, subs, per_row)
    a, b, xd = a.to(dev), b.to(dev), x.to(dev)
    batch = LoraBatch.from_runs(slots, lens, dev, triton=True)
    y = y0.to(dev)
    lora_apply(xd, y, a, b, subs, batch)
    assert torch.allclose(y.double().cpu(), want, atol=2e-2, rtol=2e-2)
    dst = LoraBatch.buffers(LoraBatch.max_blocks(len(per_row), len(reqs)), len(per_row), dev)
    yg = y0.to(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply(xd, yg, a, b, subs, dst)  # captured over padding blocks only
    batch.copy_into(dst)
    yg.copy_(y0.to(dev))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
