"""The GPU's sampling path for grammar rows, run on the CPU: the engine's FusedDraw made
available on the CPU (its one-pass Triton draw runs in Triton's interpreter there, as
tests/conftest.py sets it up), so a batch of grammar rows beside a plain row goes
through the model runner's choice of the one-pass draw, the bitmask's mask rows and the
draw's masking, end to end on the default model: each grammar output matches its regex or
validates against its schema, greedy and sampled; the plain row is drawn unmasked; the
draw took a bitmask; KV balances. The kernel itself is checked against xgrammar's apply in
tests/test_triton_kernels_interpreted.py, and on a GPU in tests/test_gpu*.py."""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

import jsonschema
import pytest
import torch

import sgl
from tests.conftest import assert_kv_balanced

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton's interpreter is on only without a GPU (tests/conftest.py)")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
PATTERN = r"(cat|dog)-[0-9]{3}"


def test_grammar_rows_draw_in_one_pass_with_their_bitmask(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl.kernels import sampling
    from sgl.sched.models.default_model import default_model_dir

    real = sampling.gumbel_draw
    masks: list[str] = []  # per draw: "none", "mixed" (mask rows beside plain ones) or "every"

    def draw(*args: Any, **kw: Any) -> torch.Tensor:
        bitmask = args[5] if len(args) > 5 else kw.get("bitmask")
        masks.append("none" if bitmask is None else "every" if bitmask.rows is None else "mixed")
        # A few large tiles: the interpreter's cost is per operation, not per element.
        return real(*args, **kw, lanes=4096, tiles=4)

    def init(self: sampling.FusedDraw, device: torch.device, seed: int) -> None:
        self.seed = torch.tensor([seed], dtype=torch.int64, device=device)
        self.offset = torch.zeros(1, dtype=torch.int64, device=device)

    monkeypatch.setattr(sampling, "gumbel_draw", functools.wraps(real)(draw))
    monkeypatch.setattr(sampling.FusedDraw, "available", staticmethod(lambda device: True))
    monkeypatch.setattr(sampling.FusedDraw, "__init__", init)
    jobs: list[dict[str, Any]] = [
        {"regex": PATTERN, "temperature": 0.0}, {"regex": PATTERN, "temperature": 0.9},
        {"json_schema": json.dumps(SCHEMA), "temperature": 0.0},
        {"json_schema": json.dumps(SCHEMA), "temperature": 0.9},
        {"temperature": 0.9, "ignore_eos": True, "max_new_tokens": 12},
    ]
    with sgl.Engine(default_model_dir(), dtype="float32", transport="inproc", max_total_tokens=4000) as e:
        outs = e.generate([f"Answer {i}:" for i in range(len(jobs))], [{"max_new_tokens": 40, **j} for j in jobs])
        assert_kv_balanced(e.get_server_info())
    for j, o in zip(jobs, outs):
        if "regex" in j:
            assert re.fullmatch(PATTERN, o["text"]), o["text"]
        elif "json_schema" in j:
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
        else:
            assert len(o["output_ids"]) == 12
    # The warm-up drew unmasked; the batch with the plain row by mask rows; the grammar rows alone by theirs.
    assert {"none", "mixed", "every"} <= set(masks), masks
