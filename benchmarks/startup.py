"""Start-up to ready: `sgl.Engine(...)` from the call to its return, ready to
serve, on the Qwen3-0.6B architecture with dummy weights (or --config), each start
in a fresh set of child processes. The first start of a machine pays for cold caches
(the OS page cache, CUDA's module loading); the later ones are the warm numbers.
The scheduler's own phases come from its info: weights, KV pools, CUDA graphs; the
rest (interpreters, imports, the attention backend, the detokenizer) is "other".

    python -m benchmarks.startup [--repeat 3] [--config qwen3-0.6b] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import sgl
from benchmarks.common import dummy_model_dir, machine, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--config", default="qwen3-0.6b", help="an architecture of benchmarks/configs")
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    model_dir = dummy_model_dir(a.config)
    kw: dict[str, object] = {} if a.device == "auto" else {"device": a.device}
    rows = []
    for i in range(a.repeat):
        t0 = time.perf_counter()
        with sgl.Engine(model_dir, transport="ipc", load_format="dummy", skip_tokenizer_init=True, random_seed=0,
                        **kw) as e:
            ready = time.perf_counter() - t0
            phases = dict(e.get_server_info().get("startup", {}))
            e.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 2})
        phases = {k: float(v) for k, v in phases.items()}
        rows.append({"start": i + 1, "ready s": ready, **phases, "other s": ready - sum(phases.values())})
        print(f"start {i + 1}: ready in {ready:.2f} s {phases}", flush=True)
    print(f"Start-up on {machine()}, {a.config} (dummy weights)")
    print(table(rows))
    warm = sorted(float(r["ready s"]) for r in rows[1:]) or [float(rows[0]["ready s"])]  # type: ignore[arg-type]
    print(f"RESULT name=startup first_s={float(rows[0]['ready s']):.2f} warm_median_s={warm[len(warm) // 2]:.2f}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
