"""Tensor and data parallelism on GPUs (marked gpu; skipped with fewer than 2): NCCL,
FlashInfer, CUDA graphs and the overlap loop on every rank. TP=2 gives TP=1's greedy
tokens on the same batch within bf16 (the ranks' sums round differently, so a near-tie
may flip: the tokens agree on most positions and the chosen logprobs closely), DP=2
gives TP=1's tokens exactly (each replica is a whole engine), and KV balances."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import sgl
from tests.conftest import assert_kv_balanced, tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _run(model_dir: str, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    with sgl.Engine(model_dir, transport="ipc", skip_tokenizer_init=True, dtype="bfloat16", **kw) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "min_new_tokens": 16,
                                                              "temperature": 0})
        info = e.get_server_info()
    assert_kv_balanced(info)
    assert info["failures"] == 0
    return [o["output_ids"] for o in outs]


def test_tp2_and_dp2_against_tp1(tmp_path: Path) -> None:
    d = tiny_model_dir(tmp_path, "qwen3", vocab=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, intermediate_size=512)
    rng = random.Random(0)
    prompts = [[rng.randrange(2000) for _ in range(rng.randrange(5, 200))] for _ in range(32)]
    one = _run(d, prompts)
    assert _run(d, prompts, dp_size=2) == one
    two = _run(d, prompts, tp_size=2)
    same = sum(a == b for x, y in zip(one, two) for a, b in zip(x, y)) / sum(map(len, one))
    assert same > 0.9, same
