"""Piecewise graphs of extend batches (sgl.sched.runner.prefill_graph): the forward in
pieces over the fixed, padded buffers equals the whole forward. On the CPU the pieces
run eagerly (capture=False), which checks everything but the capture itself: the
split at each attention, the padding rows (token 0, position 0, KV slot 0), the
buffers between pieces, the logits and pooled rows taken from padded hidden states.
Whole generations (prefix-cache hits, chunked prompts, batches larger than the
largest piece falling back to the eager forward, prompt logprobs, embeddings) are
compared with the same engine without the pieces. The captured graphs are checked on
the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

import sgl
from sgl.sched.runner.model_runner import ModelRunner
from sgl.sched.runner.prefill_graph import PrefillGraphs
from tests.conftest import assert_kv_balanced, tiny_model_dir

PIECE_TOKENS = 64  # the largest piece: batches above it (up to the 96-token chunk) run eagerly


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("pieces"), "qwen3", vocab=512, head_dim=16)


def _eager_pieces(runner: ModelRunner) -> None:
    """In place of ModelRunner._capture_graphs: extend batches through the pieces, eagerly."""
    runner.prefill_graphs = PrefillGraphs(runner, PIECE_TOKENS, capture=False)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(1, 500) for _ in range(40)]
    return ([shared + [rng.randrange(1, 500) for _ in range(rng.randint(1, 30))] for _ in range(5)]
            + [[rng.randrange(1, 500) for _ in range(n)] for n in (1, 7, 63, 64, 65, 150, 250)])


def _generate(model_dir: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    prompts = _prompts()
    with sgl.Engine(model_dir, transport="inproc", skip_tokenizer_init=True, max_total_tokens=4096,
                    chunked_prefill_size=96, disable_overlap_schedule=True) as e:
        e.generate(input_ids=prompts[0], sampling_params=params)  # the shared prefix, cached
        outs = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=2)
        info = e.get_server_info()
        assert_kv_balanced(info)
    return outs, info


def _logprobs(out: dict[str, Any]) -> list[float]:
    meta = out["meta_info"]
    return [lp for key in ("input_token_logprobs", "output_token_logprobs")
            for lp, *_ in meta[key] if lp is not None]


def test_pieces_equal_the_whole_forward(qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plain, plain_info = _generate(qwen3_dir)
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "_capture_graphs", _eager_pieces)
        pieced, info = _generate(qwen3_dir)
    assert plain_info["prefill_graph_steps"] == 0 and info["prefill_graph_steps"] > 0
    assert [o["output_ids"] for o in pieced] == [o["output_ids"] for o in plain]
    for a, b in zip(pieced, plain):
        got, want = _logprobs(a), _logprobs(b)
        assert len(got) == len(want) and all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(got, want))


def test_pooled_rows_of_pieces_equal_the_whole_forward(qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = [[5, 6, 7], list(range(1, 60)), list(range(2, 130))]

    def embed() -> list[list[float]]:
        with sgl.Engine(qwen3_dir, transport="inproc", skip_tokenizer_init=True, is_embedding=True,
                        pooling="mean", max_total_tokens=2048) as e:
            return [o["embedding"] for o in e.encode(input_ids=texts)]

    plain = embed()
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "_capture_graphs", _eager_pieces)
        pieced = embed()
    for a, b in zip(pieced, plain):
        assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b))


def _eager_draft_pieces(runner: ModelRunner) -> None:
    """In place of ModelRunner._capture_graphs: a draft model's catch-up through its own
    pieces, eagerly (the target's forwards stay whole), the short ones too (which take
    decode rows otherwise)."""
    assert runner.draft is not None
    runner.draft.prefill_graphs = PrefillGraphs(runner.draft, PIECE_TOKENS, capture=False)
    runner.draft.catch_up_rows = 0


def test_a_draft_models_pieces_propose_what_its_whole_forward_does(qwen3_dir: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """STANDALONE with the target as its own draft: through the draft's pieces (its own
    buffers, KV pool and attention backend) its greedy proposals are the target's tokens,
    so nearly all are taken, and the outputs are plain decoding's. A catch-up above the
    largest piece (the long prompt's) runs whole."""
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (3, 9, 14, 20, 150)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outs = []
    for spec in ({}, {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": qwen3_dir,
                      "speculative_num_draft_tokens": 4}):
        with monkeypatch.context() as m:
            m.setattr(ModelRunner, "_capture_graphs", _eager_draft_pieces if spec else lambda runner: None)
            with sgl.Engine(qwen3_dir, transport="inproc", skip_tokenizer_init=True, max_total_tokens=4096,
                            chunked_prefill_size=256, disable_overlap_schedule=True, **spec) as e:
                outs.append([o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)])
                info = e.get_server_info()
                assert_kv_balanced(info)
    assert outs[1] == outs[0]
    assert info["spec_draft_graph_forwards"] >= 5  # every catch-up but the first
    assert info["spec_accepted_tokens"] > 0.9 * info["spec_proposed_tokens"] > 50
