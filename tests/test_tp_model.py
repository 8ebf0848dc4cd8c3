"""Tensor parallelism of the model on CPU: two real processes joined over gloo
(`init_tp`), each loading its shard of a tiny random Hugging Face model, give the
same logits as one process (float32, within 1e-5, the same greedy tokens) on a
packed ragged prefill and the decode step after it, and both ranks give identical
logits. The cases cover KV heads split and replicated (1 KV head < tp), q/k/v, o and
MLP biases, q/k norm, a tied embedding over an odd vocab (padded to a multiple of
tp), dummy weights (tp=2 must draw the same model as tp=1) and a GGUF file.

One process pair runs every case and sends its results back to the test; it starts
while the test writes the models, and the tp=1 references are computed meanwhile. Nothing here needs a GPU."""

from __future__ import annotations

import socket
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from paged_driver import PagedDriver
from test_gguf import _write_gguf
from test_models_vs_hf import make_hf_dir
from transformers import AutoConfig

from sgl.sched.models.llama import LlamaForCausalLM
from sgl.sched.models.loader import load_model
from sgl.sched.models.parallel import TPGroup, init_tp
from tests.conftest import tiny_model_dir

CPU = torch.device("cpu")
TP = 2
# (arch, vocab, config overrides); tiny_model_dir's defaults: 4 q heads, 2 KV heads.
CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "llama-bias": ("llama", 128, {"attention_bias": True, "mlp_bias": True}),  # o/down bias added once
    "qwen2-kv1": ("qwen2", 128, {"num_key_value_heads": 1}),  # q/k/v bias; the one KV head on both ranks
    "qwen3-tied": ("qwen3", 509, {"tie_word_embeddings": True, "head_dim": 32}),  # q/k norm; 509 -> 510 rows
}
# Taken modulo the vocab: 254/255 straddle the ranks' vocab halves of 509, 508 is the last real id.
PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [254, 255], [64, 508, 66, 1, 0, 120, 33, 12, 300], [7]]
Run = tuple[str, str, str]  # (name, model path, load_format)


def _runs(tmp_path: Path) -> list[Run]:
    runs: list[Run] = []
    for case, (arch, vocab, overrides) in CASES.items():
        path = tiny_model_dir(tmp_path / case, arch, vocab, **overrides)
        # HF initializes biases to zero and norms to one; dummy weights make them random too.
        runs += [(case, path, "auto"), (f"{case}-dummy", path, "dummy")]
    hf, _ = make_hf_dir(tmp_path, "llama")  # randomized, with llama.cpp's Q/K permutation in the file
    _write_gguf(hf, "llama", tmp_path / "llama.gguf")
    return [*runs, ("llama-gguf", str(tmp_path / "llama.gguf"), "auto")]


def _forward(path: str, load_format: str, tp: TPGroup) -> dict[str, Any]:
    """Prefill the prompts packed in one batch, then one decode step of their greedy tokens."""
    model, _ = load_model(path, load_format, torch.float32, CPU, seed=7, tp=tp)
    drv = PagedDriver(model)  # its KV pool has the model's (this rank's) KV heads
    prompts = [[t % model.vocab_size for t in p] for p in PROMPTS]
    rows = [drv.new_request() for _ in prompts]
    prefill = drv.extend(rows, prompts)
    decode = drv.extend(rows, [[t] for t in prefill.argmax(-1).tolist()])
    return {"prefill": prefill.numpy(), "decode": decode.numpy(), "heads": (model.num_heads, model.num_kv_heads)}


def _rank_main(rank: int, port: int, inbox: Any, out: Any) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    try:
        tp = init_tp(rank, TP, f"tcp://127.0.0.1:{port}", CPU)
        runs: list[Run] = inbox.get(timeout=60)
        out.put((rank, {name: _forward(path, fmt, tp) for name, path, fmt in runs}))
        torch.distributed.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tp2_logits_equal_tp1(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    inbox, out = ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, inbox, out), daemon=True) for r in range(TP)]
    for p in procs:
        p.start()  # the ranks start up while the models are written
    try:
        runs = _runs(tmp_path)
        for _ in procs:
            inbox.put(runs)
        expected = {name: _forward(path, fmt, TPGroup()) for name, path, fmt in runs}
        got: dict[int, dict[str, Any]] = {}
        while len(got) < TP:
            rank, result = out.get(timeout=120)
            assert isinstance(result, dict), f"rank {rank} failed:\n{result}"  # its peer may hang: killed below
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for name, want in expected.items():
        r0, r1 = got[0][name], got[1][name]
        local_heads = (want["heads"][0] // TP, max(1, want["heads"][1] // TP))
        assert r0["heads"] == r1["heads"] == local_heads, name
        for step in ("prefill", "decode"):
            assert np.array_equal(r0[step], r1[step]), f"{name} {step}: the ranks' logits differ"
            assert r0[step].shape == want[step].shape, name
            diff = float(np.abs(r0[step] - want[step]).max())
            assert diff <= 1e-5, f"{name} {step}: tp=2 logits differ from tp=1 by {diff}"
            assert (r0[step].argmax(-1) == want[step].argmax(-1)).all(), f"{name} {step}: a greedy token flipped"


@pytest.mark.parametrize(
    ("heads", "kv_heads", "inter", "match"),
    [
        (6, 6, 128, "num_attention_heads=6 does not split over tp_size=4"),
        (8, 6, 128, "num_key_value_heads=6 and tp_size=4"),
        (8, 8, 130, "130 does not split over tp_size=4"),
    ],
)
def test_unsplittable_shapes_name_tp_size(heads: int, kv_heads: int, inter: int, match: str) -> None:
    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=8 * heads, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
    )
    with pytest.raises(ValueError, match=match):
        LlamaForCausalLM(config, device="meta", tp=TPGroup(rank=0, size=4))
