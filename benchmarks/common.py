"""Helpers shared by the benchmark scripts: random prompts, the scheduler loop split,
the result table, and W6's shape (also read by the vLLM side: nothing here imports sgl)."""

from __future__ import annotations

import platform
import random
from dataclasses import dataclass
from typing import Any


@dataclass
class Shape:
    """One W6 workload: beam width, requests x input ids, new tokens, and a trie if any."""

    workload: str
    width: int
    requests: int
    input_len: int
    output_len: int
    trie: list[list[int]] | None = None


def random_prompts(n: int, length: int, vocab: int, seed: int = 0, low: int = 100) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(n)]


def w2_requests(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """W2's prompts and output lengths: both lengths uniform in [100, 1024], ids in [0, 10000)."""
    rng = random.Random(seed)
    ins = [rng.randint(100, 1024) for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    return [[rng.randrange(10000) for _ in range(k)] for k in ins], outs


def dummy_model_dir(config_name: str = "qwen3-0.6b") -> str:
    """A model directory holding only config.json, for load_format="dummy"."""
    import os
    import shutil
    import tempfile

    src = os.path.join(os.path.dirname(__file__), "configs", f"{config_name}.json")
    d = os.path.join(tempfile.gettempdir(), f"sgl-bench-{config_name}")
    os.makedirs(d, exist_ok=True)
    shutil.copy(src, os.path.join(d, "config.json"))
    return d


def with_architecture(model: str, config_name: str) -> str:
    """A model directory of the benchmark architecture `config_name` holding `model`'s
    tokenizer files, its bos/eos/pad ids in the config (for load_format="dummy")."""
    import json
    import os
    import shutil

    d = dummy_model_dir(config_name) + "-tokenizer"
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(model):
        if f != "config.json" and not f.endswith((".safetensors", ".gguf", ".bin")):
            shutil.copy(os.path.join(model, f), os.path.join(d, f))
    with open(os.path.join(dummy_model_dir(config_name), "config.json")) as fh:
        cfg = json.load(fh)
    with open(os.path.join(model, "config.json")) as fh:
        own = json.load(fh)
    cfg.update({k: own[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in own})
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return d


LOOP_FIELDS = ("decode_steps", "prefill_tokens", "cascade_steps", "build_s", "wait_s", "process_s", "mask_wait_s",
               "gpu_busy_s", "gpu_idle_s", "gpu_decode_busy_s", "gpu_decode_idle_s", "mask_start_s", "mask_accept_s",
               "mask_fill_s", "mask_thread_s", "sample_queue_s")


def loop_split(before: dict[str, object], after: dict[str, object]) -> dict[str, float]:
    """What the scheduler did between two get_server_info() answers: steps, tokens, its
    loop time (building batches, waiting for results, processing them) and GPU busy/idle."""
    # .get: an older checkout's scheduler (benchmarks/gpu/run.sh's `old` steps) lacks some fields.
    return {k: round(float(after.get(k, 0)) - float(before.get(k, 0)), 3) for k in LOOP_FIELDS}  # type: ignore[arg-type]


def allowed_ids(row: Any, width: int) -> Any:
    """The token ids one row of a grammar bitmask allows (a host int32 row, as numpy), ascending."""
    import numpy as np

    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:width])


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import os

    return f"{platform.processor() or platform.machine()} x{os.cpu_count()} (CPU)"


def table(rows: list[dict[str, object]]) -> str:
    cols = list(rows[0])
    width = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    lines = [" | ".join(c.ljust(width[c]) for c in cols), "-+-".join("-" * width[c] for c in cols)]
    lines += [" | ".join(_fmt(r[c]).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _fmt(v: object) -> str:
    return f"{v:,.1f}" if isinstance(v, float) else str(v)
