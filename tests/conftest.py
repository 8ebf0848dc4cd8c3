"""Shared fixtures: strict KV accounting in every scheduler, offline Hugging Face,
and small model directories made on the fly."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Inherited by every child role: the scheduler raises (and dies) on broken KV accounting.
os.environ["SGL_STRICT_INVARIANTS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in Triton's interpreter (tests/test_triton_kernels_interpreted.py).
# It must be on before triton is first imported: triton.language's own jit helpers are built then.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TRANSPORTS = ["inproc", "ipc", "tcp"]
# End-to-end engines: every transport with the overlap loop, and the plain loop once.
# The overlap loop is off by default on CPU; the tests run it on purpose.
ENGINE_VARIANTS = [
    pytest.param({"transport": t, "disable_overlap_schedule": False}, id=t) for t in TRANSPORTS
] + [pytest.param({"transport": "inproc", "disable_overlap_schedule": True}, id="inproc-no-overlap")]
NULL_VOCAB = 1000


@pytest.fixture(scope="session")
def null_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A config-only model directory for the null model (no tokenizer: input_ids only)."""
    d = tmp_path_factory.mktemp("null-model")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": NULL_VOCAB,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "eos_token_id": NULL_VOCAB - 1,
        "bos_token_id": 0,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="module")
def default_config_dir() -> str:
    """The default model's config and tokenizer, for dummy weights: `.lt/` at the repo root
    (benchmarks/gpu/README.md says how to make it), else the default model itself; the test
    is skipped where neither is."""
    carried = Path(__file__).resolve().parent.parent / ".lt"
    if (carried / "tokenizer.json").exists():
        return str(carried)
    from sgl.sched.models.default_model import DefaultModelError, default_model_dir

    try:
        return default_model_dir()
    except DefaultModelError as e:
        pytest.skip(f"no tokenizer-bearing model here: {e}")


@pytest.fixture(autouse=True)
def balanced(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that uses an `engine` fixture, its KV accounting balances, once
    the aborts a test left behind (a stream left early, a batch's siblings cancelled by
    one's error) have landed."""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        settle_aborts(engine)
        assert_kv_balanced(engine.get_server_info())


def settle_aborts(engine: Any) -> None:
    """Let the aborts in flight reach the scheduler and their requests end: each
    server-info round trip follows them on the same channel, and a request aborted while
    its batch is in flight ends with that batch's results."""
    for _ in range(100):
        info = engine.get_server_info()
        if info["running"] == 0 and info["waiting"] == 0:
            break


def assert_kv_balanced(info: dict[str, Any]) -> None:
    """Idle scheduler: every KV slot is free or in the radix tree, nothing is locked (the
    testing kit's leak check, which users' tests run too)."""
    from sgl.testing.contract import assert_no_leaks

    assert_no_leaks(info)


def other_rank_failed(only: int | None = None) -> Any:
    """A tensor-parallel group in which another rank failed its part of every call, or of
    the `only`-th agreement alone (counting from 1): each such agreement (`min_int`,
    `all_ok`) comes back failed, with no second process."""
    from sgl.sched.models.parallel import TPGroup

    class OtherRankFailed(TPGroup):
        agreed = 0

        def min_int(self, n: int) -> int:
            self.agreed += 1
            return 0 if only is None or self.agreed == only else n

    return OtherRankFailed()


def null_continuation(last: int, n: int) -> list[int]:
    """The null model's greedy tokens after `last`, in this suite's NULL_VOCAB."""
    from sgl.testing.engines import null_continuation as continuation

    return continuation(last, n, NULL_VOCAB)


def generate_after_prefix(e: Any, shared: list[int], prompts: list[list[int]],
                          params: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """On engine `e`: one request of `shared` (so the radix cache holds it), then `prompts`
    with their top logprobs; their outputs and the engine's info, its KV balanced."""
    e.generate(input_ids=shared + [1], sampling_params=params)
    outs = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=3)
    info = e.get_server_info()
    assert_kv_balanced(info)
    return outs, info


def assert_top_logprobs_agree(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float = 0.02) -> int:
    """Two greedy runs of one batch that compute in other shapes or orders (other kernels,
    graphs' padded GEMMs, prefix-cached prefill) round apart in bf16 or fp16, and a random
    tiny model's logits are nearly flat, so a near-tie may flip. Up to each request's first
    flip every step's top logprobs (asked with top_logprobs_num) agree within `tol`; the
    number of requests that flipped."""
    flips = 0
    for x, y in zip(a, b, strict=True):
        for j, (s, t) in enumerate(zip(x["output_ids"], y["output_ids"])):
            xt, yt = ([v for v, _, _ in o["meta_info"]["output_top_logprobs"][j]] for o in (x, y))
            assert max(abs(p - q) for p, q in zip(xt, yt)) < tol, (j, xt, yt)
            if s != t:
                flips += 1
                break
    return flips


def tiny_model_dir(base: Path, arch: str, vocab: int, seed: int = 0, **overrides: Any) -> str:
    """A tiny random Hugging Face model saved as safetensors (float32)."""
    import torch
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[arch]
    kw: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                              eos_token_id=vocab - 1, bos_token_id=0, tie_word_embeddings=False)
    kw.update(overrides)
    config = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    d = base / f"{arch}-{seed}"
    model.save_pretrained(d, safe_serialization=True)
    return str(d)


@pytest.fixture(scope="session")
def peer_server() -> Iterator[Any]:
    """The real server the two OpenAI conformance modules share (one start for both)."""
    import signal

    from tests.peer_util import start_server

    s = start_server()
    yield s
    assert s.stop(signal.SIGTERM) == 0
