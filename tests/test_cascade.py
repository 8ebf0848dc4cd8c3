"""Cascade decode (a prefix shared by the whole batch read once): the shared-prefix
length against a plain model, and whole generations with cascade forced on equal to
the same engine with it off, token for token (the torch backend reassembles the
cascade into per-request gathers, so any mistake in the split shows as different
tokens). FlashInfer's cascade kernels are checked in tests/test_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sgl
from sgl.sched.runner import prepare
from sgl.sched.runner.prepare import shared_prefix_len
from tests.conftest import assert_kv_balanced, tiny_model_dir


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_shared_prefix_len_matches_plain_model(data: st.DataObject) -> None:
    n_rows = data.draw(st.integers(1, 6))
    width = data.draw(st.integers(1, 12))
    common = data.draw(st.integers(0, width))
    # Rows share `common` slots, then draw freely from a tiny alphabet (so accidental agreement happens).
    head = data.draw(st.lists(st.integers(0, 3), min_size=common, max_size=common))
    tail = st.lists(st.integers(0, 3), min_size=width - common, max_size=width - common)
    table = torch.tensor([head + data.draw(tail) for _ in range(n_rows)], dtype=torch.int32)
    rows = torch.tensor(data.draw(st.permutations(range(n_rows))), dtype=torch.int64)
    limit = data.draw(st.integers(0, width))
    expected = 0
    while expected < limit and len({int(table[r, expected]) for r in rows}) == 1:
        expected += 1
    assert shared_prefix_len(table, rows, limit) == expected


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("cascade"), "llama", vocab=512, hidden_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def _generate(model_dir: str, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], int]:
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with sgl.Engine(model_dir, transport="inproc", skip_tokenizer_init=True, max_total_tokens=4096, **kw) as e:
        e.generate(input_ids=prompts[0], sampling_params=params)  # caches the shared prefix first
        outs = e.generate(input_ids=prompts, sampling_params=params)
        info = e.get_server_info()
        assert_kv_balanced(info)
    return [o["output_ids"] for o in outs], info["cascade_steps"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_cascade_decode_equals_plain_decode(llama_dir: str, monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    rng = random.Random(1)
    shared = [rng.randrange(1, 500) for _ in range(60)]
    # Different suffix lengths, so requests finish their prompts and join decode at different steps.
    prompts = [shared + [rng.randrange(1, 500) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    prompts.append([rng.randrange(1, 500) for _ in range(20)])  # one request without the prefix
    monkeypatch.setattr(prepare, "CASCADE_MIN_SAVED_TOKENS", 1)
    kw = {"disable_overlap_schedule": not overlap}
    plain, plain_steps = _generate(llama_dir, prompts, **kw)  # the torch backend's default: off
    cascade_mixed, _ = _generate(llama_dir, prompts, enable_cascade_attention=True, **kw)
    cascade, steps = _generate(llama_dir, prompts[:-1], enable_cascade_attention=True, **kw)
    assert plain_steps == 0 and steps > 0
    assert cascade == plain[:-1]
    assert cascade_mixed == plain
