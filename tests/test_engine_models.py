"""End to end with real model arithmetic, over every transport: the default model
(SmolLM2-135M-Instruct, float32) greedy output equals Hugging Face transformers
token for token on a batch of prompts of different lengths, streamed text adds
up to the final text, and 64 concurrent AsyncEngine requests each equal the same
request run alone."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
import torch

import sgl
from tests.conftest import ENGINE_VARIANTS, TRANSPORTS, assert_kv_balanced, tiny_model_dir

PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter who",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm_dir() -> str:
    from sgl.sched.models.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def hf_greedy(smollm_dir: str) -> list[list[int]]:
    """HF's greedy continuation of each prompt, run alone (no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm_dir, torch_dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


@pytest.fixture(scope="module", params=ENGINE_VARIANTS)
def engine(request: pytest.FixtureRequest, smollm_dir: str) -> Iterator[sgl.Engine]:
    e = sgl.Engine(smollm_dir, **request.param, dtype="float32", max_total_tokens=4096,
                   max_running_requests=8)
    yield e
    assert_kv_balanced(e.get_server_info())
    e.shutdown()


def test_smollm2_batch_equals_hf(engine: sgl.Engine, hf_greedy: list[list[int]]) -> None:
    outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == hf_greedy
    tok = engine.tokenizer
    for o in outs:
        assert o["text"] == tok.decode(o["output_ids"], skip_special_tokens=True)


def test_smollm2_stream_adds_up_to_the_text(engine: sgl.Engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 24}
    full = engine.generate("Write one sentence about the sea, with an emoji:", params)
    chunks = list(engine.generate("Write one sentence about the sea, with an emoji:", params, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert not any("\ufffd" in c["text"] for c in chunks)


def test_smollm2_answers_paris(engine: sgl.Engine) -> None:
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), "qwen3", vocab=512, num_hidden_layers=2, head_dim=32)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_64_concurrent_requests_equal_each_alone(tiny_dir: str, transport: str) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(1, 60))] for _ in range(64)]
    lengths = [rng.randint(1, 24) for _ in range(64)]

    async def main() -> None:
        async with sgl.AsyncEngine(tiny_dir, transport=transport, skip_tokenizer_init=True, max_total_tokens=8192,
                                   max_running_requests=64) as e:
            def params(n: int) -> dict:
                return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}

            together = await asyncio.gather(*(e.generate(input_ids=p, sampling_params=params(n))
                                              for p, n in zip(prompts, lengths)))
            alone = [await e.generate(input_ids=p, sampling_params=params(n)) for p, n in zip(prompts, lengths)]
            assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]
            assert [len(o["output_ids"]) for o in together] == lengths
            assert_kv_balanced(await e.get_server_info())

    asyncio.run(main())
