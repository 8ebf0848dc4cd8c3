"""Where one decode step's time goes: a batch of B requests at context C (W1's
middle is 256 x 768), Qwen3-0.6B architecture with dummy weights, driven through
the real ModelRunner (prepare -> launch -> result) without the scheduler.

Prints the host time to prepare a step, the GPU time of a step (CUDA-graph replay
and eager), the kernels of a few steps by GPU time (torch.profiler), and, on CUDA,
FlashInfer's decode attention alone with and without tensor cores.

    python -m benchmarks.profile_decode [--bs 256] [--ctx 768] [--steps 30] [--temperature 0]
    python -m benchmarks.profile_decode --ctx 2164 --shared 2000 --no-graphs   # W3's decode, cascade on
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import dummy_model_dir, machine, table
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.runtime.child import gpu_scheduler_process
from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req
from sgl.sched.runner.model_runner import ModelRunner
from sgl.sched.runner.prepare import indptr_of


def make_runner(bs: int, ctx: int, steps: int, graphs: bool, cascade: bool) -> ModelRunner:
    args = ServerArgs(load_format="dummy", max_total_tokens=bs * (ctx + steps + 8), max_running_requests=bs,
                      random_seed=0, skip_tokenizer_init=True, disable_cuda_graph=not graphs,
                      cuda_graph_max_bs=bs, enable_cascade_attention=cascade)
    return ModelRunner(args, dummy_model_dir())


def make_reqs(runner: ModelRunner, bs: int, ctx: int, temperature: float, shared: int = 0) -> list[Req]:
    """bs requests of ctx tokens, the first `shared` of them on the same slots (W3's shape)."""
    reqs = []
    own = ctx - shared
    slots = runner.allocator.alloc(shared + bs * own)
    assert slots is not None
    # Shuffled slots, as a long-running server's pool would be: reads are not contiguous.
    slots = slots[torch.randperm(slots.numel())].to(torch.int32)
    for i in range(bs):
        r = Req(f"r{i}", [1] * ctx, SamplingParams(temperature=temperature, max_new_tokens=1 << 20), False)
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        pool = runner.req_to_token_pool
        pool.write(r.req_pool_idx, 0, torch.cat([slots[:shared], slots[shared + i * own:shared + (i + 1) * own]]))
        r.kv_len = ctx
        reqs.append(r)
    return reqs


def step(runner: ModelRunner, reqs: list[Req]) -> tuple[float, float]:
    """One decode step; (host seconds to build and prepare it, wall seconds in all)."""
    t0 = time.perf_counter()
    out = runner.allocator.alloc(len(reqs))
    assert out is not None
    p = runner.prepare(ScheduleBatch.decode(reqs, out, runner.req_to_token_pool))
    t1 = time.perf_counter()
    runner.launch(p).result()
    return t1 - t0, time.perf_counter() - t0


def host_profile(runner: ModelRunner, reqs: list[Req], steps: int = 10) -> None:
    """cProfile of the host side of a decode step (build the batch, prepare it, queue
    the forward), where the overlap loop needs it to stay under the GPU step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(steps):
        out = runner.allocator.alloc(len(reqs))
        assert out is not None
        prof.enable()
        p = runner.prepare(ScheduleBatch.decode(reqs, out, runner.req_to_token_pool))
        launched = runner.launch(p)
        prof.disable()
        launched.result()
    print(f"--- host side of {steps} decode steps (build, prepare, queue), by cumulative time")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--shared", type=int, default=0, help="leading slots all requests share (cascade decode)")
    ap.add_argument("--no-graphs", action="store_true")
    a = ap.parse_args()
    gpu_scheduler_process()  # the settings of a served engine's scheduler process
    cuda = torch.cuda.is_available()
    runner = make_runner(a.bs, a.ctx, 4 * a.steps + 8, graphs=cuda and not a.no_graphs, cascade=a.shared > 0)
    reqs = make_reqs(runner, a.bs, a.ctx, a.temperature, a.shared)
    if cuda and a.shared:
        cascade_alone(runner, reqs, a.shared)
    rows = []
    modes = [("graph", runner.graphs), ("eager", None)] if runner.graphs else [("eager", None)]
    for name, graphs in modes:
        runner.graphs = graphs
        for _ in range(3):
            step(runner, reqs)
        busy0 = runner.gpu_timeline.busy_s
        runner.gpu_timeline.reset_gap()
        host, wall = zip(*(step(runner, reqs) for _ in range(a.steps)))
        gpu_ms = (runner.gpu_timeline.busy_s - busy0) / a.steps * 1e3 if cuda else float("nan")
        rows.append({"mode": name, "prepare ms": sorted(host)[len(host) // 2] * 1e3,
                     "step wall ms": sorted(wall)[len(wall) // 2] * 1e3, "GPU ms/step": gpu_ms})
    print(f"decode step, bs={a.bs} ctx~{a.ctx}, temperature {a.temperature}, on {machine()}, torch {torch.__version__}")
    print(table(rows))

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for name, graphs in modes:
        runner.graphs = graphs
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                step(runner, reqs)
        key = "cuda_time_total" if cuda else "cpu_time_total"
        print(f"--- kernels over 5 {name} steps, by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=50))
    print(f"cascade steps: {runner.preparer.cascade_steps}")
    runner.graphs = modes[0][1]  # the host profile is of the engine's own mode: graphs where captured
    if cuda:
        host_profile(runner, reqs)
    if cuda and not a.shared:
        attention_alone(runner, reqs)


def time_us(fn: object, reps: int = 20) -> float:
    """GPU microseconds per call of fn (CUDA events around reps calls, after warm-up)."""
    for _ in range(3):
        fn()  # type: ignore[operator]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / reps * 1e3


def graph_us(fn: object, reps: int = 20) -> float:
    """GPU microseconds per call of fn, replayed from a CUDA graph (no launch cost)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()  # type: ignore[operator]
    return time_us(g.replay, reps)


def _plan_ms(plan: object) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plan()  # type: ignore[operator]
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3


def cascade_alone(runner: ModelRunner, reqs: list[Req], shared: int) -> None:
    """The pieces of one layer's cascade attention for this batch, each timed alone,
    against plain decode over the whole context: which piece (or which plan) is slow."""
    import flashinfer

    from sgl.cache.req_to_token_pool import gather_kv_indices

    m, dt, b = runner.model, runner.dtype, len(reqs)
    host = runner.req_to_token_pool.req_to_token
    lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
    rows_ = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)

    full_ptr, own_ptr = indptr_of(lens.tolist()).pin_memory(), indptr_of((lens - shared).tolist()).pin_memory()
    full = gather_kv_indices(host, rows_, torch.zeros_like(lens), lens, int(full_ptr[-1])).cuda()
    own = gather_kv_indices(host, rows_, torch.full_like(lens, shared), lens - shared, int(own_ptr[-1])).cuda()
    shared_idx = host[reqs[0].req_pool_idx, :shared].cuda()
    q = torch.randn(b, m.num_heads, m.head_dim, dtype=dt, device="cuda")
    kv = (runner.kv_pool.k_buffer[0].unsqueeze(1), runner.kv_pool.v_buffer[0].unsqueeze(1))
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ones = torch.ones(b, dtype=torch.int32).pin_memory()
    h = (m.num_heads, m.num_kv_heads, m.head_dim, 1)
    kw = {"q_data_type": dt, "kv_data_type": dt}
    plain = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    top = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    own_dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    own_pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    top_whole = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    one = torch.tensor([0, b], dtype=torch.int32).pin_memory()
    rng = torch.arange(b + 1, dtype=torch.int32).pin_memory()
    plans = {
        "plain decode plan": lambda: plain.plan(full_ptr, full, ones, *h, **kw),
        "shared block plan": lambda: top.plan(one, torch.tensor([0, shared], dtype=torch.int32).pin_memory(),
                                              shared_idx, ones[:1], *h, causal=False,
                                              seq_lens=torch.tensor([shared], dtype=torch.int32).pin_memory(), **kw),
        "shared block plan, KV not split": lambda: top_whole.plan(
            one, torch.tensor([0, shared], dtype=torch.int32).pin_memory(), shared_idx, ones[:1], *h, causal=False,
            seq_lens=torch.tensor([shared], dtype=torch.int32).pin_memory(), disable_split_kv=True, **kw),
        "suffix decode plan": lambda: own_dec.plan(own_ptr, own, ones, *h, **kw),
        "suffix prefill plan": lambda: own_pre.plan(rng, own_ptr, own, ones, *h, causal=False,
                                                    seq_lens=(lens - shared).to(torch.int32).pin_memory(), **kw),
    }
    out = [{"piece": k, "ms (host)": _plan_ms(f)} for k, f in plans.items()]
    o1, s1 = top.run(q, kv, return_lse=True)
    o2, s2 = own_dec.run(q, kv, return_lse=True)
    runs = {
        "plain decode, whole context": lambda: plain.run(q, kv),
        "shared block (prefill, B queries x P)": lambda: top.run(q, kv, return_lse=True),
        "shared block, KV not split (no merge pass)": lambda: top_whole.run(q, kv, return_lse=True),
        "suffix decode": lambda: own_dec.run(q, kv, return_lse=True),
        "suffix via prefill": lambda: own_pre.run(q, kv, return_lse=True),
        "merge_state": lambda: flashinfer.merge_state(o1, s1, o2, s2),
    }
    out += [{"piece": k, "ms (host)": float("nan"), "us/layer (GPU)": time_us(f)} for k, f in runs.items()]
    for row in out:
        row.setdefault("us/layer (GPU)", float("nan"))
    print(f"--- cascade pieces, one layer: bs={b}, shared {shared}, own ~{int(lens.float().mean()) - shared}")
    print(table(out))


def attention_alone(runner: ModelRunner, reqs: list[Req]) -> None:
    """FlashInfer decode attention for this batch, one layer, in the variants that
    could make it faster: CUDA cores or tensor cores, shuffled or contiguous slots,
    an fp8 (e4m3) copy of the KV (half the bytes), the fa3 paged-prefill kernel used
    for decode, and pages of 16 tokens in NHD and HND layouts (separate random
    tensors, pages shuffled: the kernel alone)."""
    import flashinfer

    from sgl.cache.req_to_token_pool import gather_kv_indices

    table_ = runner.req_to_token_pool.req_to_token
    lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
    b = len(reqs)
    rows_ = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    indptr = indptr_of(lens.tolist())
    idx = gather_kv_indices(table_, rows_, torch.zeros_like(lens), lens, int(indptr[-1])).cuda()
    m, dt = runner.model, runner.dtype
    h = (m.num_heads, m.num_kv_heads, m.head_dim)
    q = torch.randn(b, m.num_heads, m.head_dim, dtype=dt, device="cuda")
    kv = (runner.kv_pool.k_buffer[0].unsqueeze(1), runner.kv_pool.v_buffer[0].unsqueeze(1))
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ones = torch.ones(b, dtype=torch.int32)
    gbytes = int(indptr[-1]) * m.num_kv_heads * m.head_dim * 2 * kv[0].element_size() / 1e9
    rows = []

    def record(name: str, make: object, kv_bytes: float = 1.0) -> None:
        try:
            run = make()  # type: ignore[operator]
            us = time_us(run, reps=50)
            rows.append({"variant": name, "us/layer": us, "KV TB/s": gbytes * kv_bytes / us * 1e6 / 1e3})
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others; it is reported
            rows.append({"variant": name, "us/layer": float("nan"), "KV TB/s": float("nan")})
            print(f"{name}: {type(e).__name__}: {e}")

    def decode(indices: torch.Tensor, tc: bool) -> object:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, backend="fa2")
        w.plan(indptr, indices, ones, *h, 1, q_data_type=dt, kv_data_type=dt)
        return lambda: w.run(q, kv)

    contiguous = torch.arange(1, idx.numel() + 1, dtype=torch.int32, device="cuda")
    for layout, indices in (("shuffled", idx), ("contiguous", contiguous)):
        for tc in (False, True):
            record(f"fa2 decode, page 1, {layout}, tensor cores {tc}",
                   lambda indices=indices, tc=tc: decode(indices, tc))

    fp8 = torch.float8_e4m3fn
    kv8 = (kv[0].to(fp8), kv[1].to(fp8))

    def fp8_decode(tc: bool) -> object:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, backend="fa2")
        w.plan(indptr, idx, ones, *h, 1, q_data_type=dt, kv_data_type=fp8)
        return lambda: w.run(q, kv8)

    for tc in (False, True):
        record(f"fa2 decode, page 1, shuffled, fp8 KV, tensor cores {tc}", lambda tc=tc: fp8_decode(tc),
               kv_bytes=fp8.itemsize / kv[0].element_size())

    def fa3_decode() -> object:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
        qo = torch.arange(b + 1, dtype=torch.int32)
        w.plan(qo, indptr, idx, ones, *h, 1, causal=True, q_data_type=dt, kv_data_type=dt)
        return lambda: w.run(q, kv)

    record("fa3 paged prefill as decode, page 1, shuffled", fa3_decode)

    page = 16
    pages = ((lens + page - 1) // page).to(torch.int32)
    pindptr = indptr_of(pages.tolist())
    n_pages = int(pindptr[-1])
    last = (lens - (pages.long() - 1) * page).to(torch.int32)
    order = torch.randperm(n_pages, device="cuda").to(torch.int32)
    for layout in ("NHD", "HND"):
        shape = (
            (n_pages, page, m.num_kv_heads, m.head_dim)
            if layout == "NHD"
            else (n_pages, m.num_kv_heads, page, m.head_dim)
        )

        def paged(layout: str = layout, shape: tuple = shape) -> object:
            cache = (torch.randn(shape, dtype=dt, device="cuda"), torch.randn(shape, dtype=dt, device="cuda"))
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, layout, backend="fa2")
            w.plan(pindptr, order, last, *h, page, q_data_type=dt, kv_data_type=dt)
            return lambda: w.run(q, cache)

        record(f"fa2 decode, page {page} {layout}, pages shuffled", paged)
    print(f"--- FlashInfer decode attention alone, one layer: batch {b}, {int(indptr[-1])} KV tokens")
    print(table(rows))


if __name__ == "__main__":
    main()
