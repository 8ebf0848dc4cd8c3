"""Where a lone request's time to first token goes on the GPU: one request's prefill of
N tokens (no cache hit), Qwen3-0.6B architecture with dummy weights (or `--model DIR`),
driven through the real ModelRunner (prepare -> launch -> result) without the scheduler.

Prints, per prompt length: the host time to build and prepare the batch, to queue the
forward (launch), the wall time until the sampled token is on the host, and the GPU's
busy time (CUDA events around the step). Wall far above GPU busy means the prefill is
bound by the host queueing kernels one by one, not by the GPU. Each length runs by
variant: `eager`; `pieces`, the piecewise CUDA graphs alone (sgl.sched.runner.prefill_graph;
lengths past their largest count, 2,048 by default, run eagerly); `whole`, the engine's
default: batches the attention backend takes (FlashInfer: up to WHOLE_MAX_TOKENS tokens on
a cached prefix, so `--prefix`) through one graph of the whole forward, the rest through
the pieces (a mixed forward, with decode rows, always). Then the kernels of one
prefill by GPU time and their count, per variant. `--decode-rows N` puts N running
requests (each `--decode-kv` tokens of KV) in every prefill's forward, as a mixed batch
(enable_mixed_chunk) carries them; `--decode-shared S` makes the first S of their slots the
same ones (a shared system prompt: past enough rows, a cascade). `--prefix P` gives each
request P tokens of KV already written before its N new ones, as a prefix cache hit does
(a chat's shared system prompt). With decode rows, the row of 0 tokens is their decode step
alone: a mixed forward pays where it costs less than the prefill alone plus that step.
`--server-args` passes engine options (JSON), e.g. the decode kernel the rows run;
`--paged-extend-max N` sets the FlashInfer backend's rule for extends with cached prefixes
and for mixed forwards (one paged prefill over every row up to N tokens, else ragged +
paged + merge for the extend rows and the decode kernel for the decode rows).

    python -m benchmarks.prefill_cost [--lens 100,400,1000,4000] [--reps 20] [--model DIR]
        [--decode-rows 0] [--decode-kv 1500] [--decode-shared 0] [--prefix 0] [--variants eager,pieces,whole]
        [--server-args JSON] [--paged-extend-max N]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from benchmarks.common import dummy_model_dir, machine, table
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.runtime.child import gpu_scheduler_process
from sgl.sched.batch import ScheduleBatch
from sgl.sched.req import Req
from sgl.sched.runner import prefill_graph
from sgl.sched.runner.model_runner import ModelRunner


def running(runner: ModelRunner, rows: int, kv: int, shared: int = 0) -> list[Req]:
    """`rows` requests that decode, each with `kv` tokens of KV written, the first `shared`
    of them in the same slots for all."""
    reqs = []
    common = runner.allocator.alloc(shared) if shared else None
    for i in range(rows):
        r = Req(f"d{i}", [(5 * j + i) % 1000 + 10 for j in range(kv)], SamplingParams(temperature=0), False)
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        slots = runner.allocator.alloc(kv - shared)
        assert slots is not None and r.req_pool_idx is not None
        if common is not None:
            slots = torch.cat((common, slots))
        runner.req_to_token_pool.write(r.req_pool_idx, 0, slots)
        r.kv_len = kv
        reqs.append(r)
    return reqs


def timed(runner: ModelRunner, build: Callable[[], ScheduleBatch]) -> tuple[float, float, float]:
    """Build and prepare a batch, launch it and wait for its tokens: (prepare, launch,
    wall) seconds."""
    t0 = time.perf_counter()
    p = runner.prepare(build())
    t1 = time.perf_counter()
    launched = runner.launch(p)
    t2 = time.perf_counter()
    launched.result()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t0


def rewind(runner: ModelRunner, decoding: list[Req], step: torch.Tensor) -> None:
    """Undo a decode step of `decoding`: the same context next time."""
    runner.allocator.free(step)
    for d in decoding:
        d.kv_len -= 1


def prefill(runner: ModelRunner, n: int, decoding: list[Req] | None = None,
            prefix: torch.Tensor | None = None) -> tuple[float, float, float]:
    """One request's prefill of n tokens (with a decode step of `decoding`: a mixed batch;
    over the cached KV slots `prefix`, if given), the KV it wrote freed after; (prepare,
    launch, wall) seconds. n = 0: the decode step of `decoding` alone (what a prefill's
    forward saves them when it carries them)."""
    pool = runner.req_to_token_pool
    decoding = decoding or []
    step = runner.allocator.alloc(len(decoding)) if decoding else None
    assert step is not None or not decoding
    if n == 0:
        assert step is not None
        times = timed(runner, lambda: ScheduleBatch.decode(decoding, step, pool))
        rewind(runner, decoding, step)
        return times
    p = 0 if prefix is None else prefix.numel()
    r = Req("p", [(7 * i + 3) % 1000 + 10 for i in range(p + n)], SamplingParams(temperature=0, max_new_tokens=1),
            False)
    r.req_pool_idx = pool.alloc()
    assert r.req_pool_idx is not None
    if prefix is not None:
        pool.write(r.req_pool_idx, 0, prefix)
        r.kv_len = p
    r.extend_len = n
    out = runner.allocator.alloc(n)
    assert out is not None

    def build() -> ScheduleBatch:
        batch = ScheduleBatch.extend([r], out, pool)
        return batch if step is None else ScheduleBatch.mixed(batch, ScheduleBatch.decode(decoding, step, pool))

    times = timed(runner, build)
    runner.allocator.free(out)
    pool.free(r.req_pool_idx)
    if step is not None:
        rewind(runner, decoding, step)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="100,400,1000,4000")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model", default=None, help="a model folder (default: Qwen3-0.6B, dummy weights)")
    ap.add_argument("--decode-rows", type=int, default=0, help="running requests in each prefill's forward")
    ap.add_argument("--decode-kv", type=int, default=1500, help="each running request's KV tokens")
    ap.add_argument("--decode-shared", type=int, default=0, help="of those, the slots they all share")
    ap.add_argument("--prefix", type=int, default=0, help="cached KV tokens before each prompt's new ones")
    ap.add_argument("--variants", default="eager,pieces,whole",
                    help="eager, pieces (the piecewise CUDA graphs alone), whole (whole-forward graphs where they "
                         "take the batch, else the pieces: the default), comma-separated")
    ap.add_argument("--paged-extend-max", type=int, default=None,
                    help="FlashInfer: extends with cached prefixes and mixed forwards up to N tokens as one "
                         "paged prefill (default: the backend's PAGED_EXTEND_MAX_TOKENS; 0: never)")
    ap.add_argument("--server-args", default="{}",
                    help="engine options as JSON, e.g. '{\"decode_attention_backend\": \"flashinfer\"}'")
    a = ap.parse_args()
    gpu_scheduler_process()  # the settings of a served engine's scheduler process
    lens = [int(x) for x in a.lens.split(",")]
    if a.decode_rows:
        lens = [0, *lens]  # the rows' decode step alone first: mixed pays where it costs less than that step
    cuda = torch.cuda.is_available()
    rows = []
    # variant -> (largest piecewise count, largest whole-forward count)
    top = ServerArgs().piecewise_cuda_graph_max_tokens
    variants = {"eager": (0, 0), "pieces": (top, 0), "whole": (top, prefill_graph.WHOLE_MAX_TOKENS)}
    for variant in a.variants.split(","):
        pieces, prefill_graph.WHOLE_MAX_TOKENS = variants[variant]
        kv_total = 4 * max(lens) + 64 + a.decode_rows * (a.decode_kv + 1) + a.prefix
        # The chunk (which bounds the pieces) holds the longest prompt with its decode rows.
        args = ServerArgs(load_format="dummy", max_total_tokens=kv_total, max_running_requests=8 + a.decode_rows,
                          random_seed=0, skip_tokenizer_init=True, chunked_prefill_size=max(lens) + a.decode_rows,
                          piecewise_cuda_graph_max_tokens=pieces, **json.loads(a.server_args))
        runner = ModelRunner(args, a.model or dummy_model_dir())
        if a.paged_extend_max is not None and hasattr(runner.attn_backend, "paged_extend_max_tokens"):
            runner.attn_backend.paged_extend_max_tokens = a.paged_extend_max
        decoding = running(runner, a.decode_rows, a.decode_kv, a.decode_shared)
        prefix = runner.allocator.alloc(a.prefix) if a.prefix else None
        for n in lens:
            for _ in range(3):
                prefill(runner, n, decoding, prefix)
            busy0 = runner.gpu_timeline.busy_s
            times = [prefill(runner, n, decoding, prefix) for _ in range(a.reps)]
            med = [sorted(col)[len(col) // 2] * 1e3 for col in zip(*times)]
            gpu = (runner.gpu_timeline.busy_s - busy0) / a.reps * 1e3 if cuda else float("nan")
            rows.append({"variant": variant, "tokens": n, "cached prefix": a.prefix, "decode rows": a.decode_rows,
                         "shared": a.decode_shared,
                         "prepare ms": med[0],
                         "launch ms": med[1],
                         "wall ms": med[2], "GPU busy ms": gpu})
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        n = lens[len(lens) // 2]
        with torch.profiler.profile(activities=acts) as prof:
            prefill(runner, n, decoding, prefix)
        key = "cuda_time_total" if cuda else "cpu_time_total"
        events = prof.key_averages()
        kernels = sum(e.count for e in events if cuda and e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"--- {variant}: one prefill of {n} tokens, {kernels} GPU kernels, by {key}; start-up {runner.startup}")
        print(events.table(sort_by=key, row_limit=12, max_name_column_width=60))
        name = runner.model.__class__.__name__
        runner.close()
        del runner
    print(f"one request's prefill, {name}, on {machine()}, torch {torch.__version__}")
    print(table(rows))


if __name__ == "__main__":
    main()
