"""Structured output on the GPU path (marked gpu; skipped without CUDA): grammar rows
in the overlap loop, where a batch's forward (a CUDA graph) is queued before the
previous step's token is in the matcher and its bitmask is filled and applied after.
Each output matches its regex or validates against its schema, and equals the same
engine's without overlap (each request alone: the same batches and kernels, exact);
KV balances. Weights are random (dummy, bf16): only the masks make outputs valid.

The model is the default model's config and tokenizer: `.lt/` at the repo root (what
benchmarks/gpu/README.md says how to make it) or the default model itself."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

import sgl
from tests.conftest import assert_kv_balanced

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PATTERN = r"[a-z]{3}-[0-9]{20}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(default_config_dir: str) -> str:
    return default_config_dir


def _outputs(model_dir: str, **kw: Any) -> list[tuple[str, list[int]]]:
    jobs: list[dict[str, Any]] = [{"regex": PATTERN, "temperature": 0.7, "seed": i} for i in range(4)]
    jobs += [{"json_schema": json.dumps(SCHEMA), "temperature": 0}, {"regex": PATTERN, "temperature": 0}]
    with sgl.Engine(model_dir, transport="inproc", load_format="dummy", dtype="bfloat16",
                    attention_backend="flashinfer", max_total_tokens=40000, **kw) as e:
        outs = [e.generate(f"item {i}:", {"max_new_tokens": 64, **sp}) for i, sp in enumerate(jobs)]
        info = e.get_server_info()
        assert_kv_balanced(info)
        assert info["failures"] == 0
    return [(o["text"], o["output_ids"]) for o in outs]


def test_grammar_rows_under_overlap_and_graphs_equal_no_overlap(model_dir: str) -> None:
    overlap = _outputs(model_dir)
    serial = _outputs(model_dir, disable_overlap_schedule=True)
    assert overlap == serial
    texts = [t for t, _ in overlap]
    for t in texts[:4] + texts[5:]:
        assert re.fullmatch(PATTERN, t), t
    obj = json.loads(texts[4])
    assert set(obj) == {"name", "n"} and isinstance(obj["n"], int) and len(obj["name"]) <= 12


def test_grammar_rows_beside_plain_rows_in_one_batch(model_dir: str) -> None:
    """Grammar rows and plain rows sampled in one batch (no seeds: the one-pass draw, the
    grammar rows' bitmasks applied in it through their mask rows, the plain rows unmasked):
    every grammar output matches, every plain output runs to its length (ignore_eos), and
    the plain outputs are not all within the regex's alphabet (they were not masked)."""
    n = 12
    params: list[dict[str, Any]] = [
        {"regex": PATTERN, "temperature": 0.8, "max_new_tokens": 64} if i % 3 == 0
        else {"temperature": 0.8, "max_new_tokens": 24, "ignore_eos": True} for i in range(n)]
    with sgl.Engine(model_dir, transport="inproc", load_format="dummy", dtype="bfloat16",
                    attention_backend="flashinfer", max_total_tokens=40000) as e:
        outs = e.generate([f"item {i}:" for i in range(n)], params)
        info = e.get_server_info()
        assert_kv_balanced(info)
        assert info["failures"] == 0
    for i, o in enumerate(outs):
        if i % 3 == 0:
            assert re.fullmatch(PATTERN, o["text"]), o["text"]
        else:
            assert len(o["output_ids"]) == 24
    assert not all(re.fullmatch(r"[a-z0-9-]*", o["text"]) for i, o in enumerate(outs) if i % 3)


def test_beams_beside_grammar_rows_equal_beams_alone(model_dir: str) -> None:
    """A plain beam request decoding in the grammar rows' batches (float32, torch attention).
    A grammar batch's sampling, beam selection included, is queued late: after the next
    batch is built, before that batch is prepared. Selection moves request-table rows on the
    device; a next batch prepared before it (its KV indices gathered from that table) would
    give the beams their parents' old KV, and beams that differ from the same request alone."""
    import asyncio

    beam = {"beam_width": 4, "num_return_beams": 4, "max_new_tokens": 16}
    kw: dict[str, Any] = {"transport": "inproc", "load_format": "dummy", "dtype": "float32",
                          "attention_backend": "torch", "disable_cuda_graph": True, "max_total_tokens": 20000}

    async def run(with_grammar: bool) -> list[tuple[list[int], float]]:
        async with sgl.AsyncEngine(model_dir, **kw) as e:
            jobs = [e.generate("item 0:", beam)]
            if with_grammar:
                jobs += [e.generate(f"item {i}:", {"regex": PATTERN, "temperature": 0.7, "seed": i,
                                                   "max_new_tokens": 40}) for i in range(1, 7)]
            outs = await asyncio.gather(*jobs)
            info = await e.get_server_info()
            assert_kv_balanced(info)
            assert info["failures"] == 0
        for o in outs[1:]:
            assert re.fullmatch(PATTERN, o["text"]), o["text"]
        return [(b["output_ids"], b["meta_info"]["score"]) for b in outs[0]]

    mixed, alone = asyncio.run(run(True)), asyncio.run(run(False))
    assert [ids for ids, _ in mixed] == [ids for ids, _ in alone]
    for (_, a), (_, b) in zip(mixed, alone):
        assert abs(a - b) < 1e-3
