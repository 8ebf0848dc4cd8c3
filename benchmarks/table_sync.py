"""The request table's host cost per decode step: `write_at` of a step's new slots and
the `sync` that queues them for the device mirror (sgl.cache.req_to_token_pool), timed
on one host thread for a plain decode step (one slot per request) and a speculative one
(several consecutive slots per request). The mirror is on the CPU unless --device says
otherwise, so the number is the host's work, with the copy it queues.

    python -m benchmarks.table_sync [--requests 64] [--rows-per-request 1,5] [--device cpu]"""

from __future__ import annotations

import argparse
import time

import torch

from sgl.cache.req_to_token_pool import ReqToTokenPool


def time_step(pool: ReqToTokenPool, requests: int, per: int, reps: int) -> float:
    """Microseconds per write_at + sync of `requests` rows, `per` consecutive positions each."""
    rows = torch.arange(requests).repeat_interleave(per)
    positions = (torch.arange(requests) * 3 + 100).repeat_interleave(per) + torch.arange(per).repeat(requests)
    slots = torch.arange(rows.numel(), dtype=torch.int64)
    for _ in range(reps // 10):  # warm-up
        pool.write_at(rows, positions, slots)
        pool.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        pool.write_at(rows, positions, slots)
        pool.sync()
    if pool.mirror.is_cuda:
        torch.cuda.synchronize(pool.mirror.device)
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rows-per-request", default="1,5")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    torch.set_num_threads(1)  # as a GPU scheduler's process runs its host ops (sgl.runtime.child)
    pool = ReqToTokenPool(512, 4096, a.device)
    for per in (int(x) for x in a.rows_per_request.split(",")):
        us = time_step(pool, a.requests, per, a.reps)
        print(f"{a.requests} requests x {per} slots: {us:.1f} us per write_at + sync", flush=True)


if __name__ == "__main__":
    main()
