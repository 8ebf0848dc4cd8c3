"""Logprobs against Hugging Face on a tiny random Llama (float32), over every engine
variant: output, prompt (through chunked prefill and a warm radix cache), top-k
and chosen-id logprobs all equal log_softmax of HF's logits within 1e-4, for
greedy and for sampled, penalised requests alike (raw logits, before sampling
transforms), streamed deltas add up to the final lists; a max_new_tokens=0 request
still gets its prompt logprobs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import sgl
from tests.conftest import ENGINE_VARIANTS, assert_kv_balanced, tiny_model_dir

VOCAB = 512
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-lp"), "llama", vocab=VOCAB, seed=3)


@pytest.fixture(scope="module")
def hf_model(tiny_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is log P(. | ids[:p + 1])."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module", params=ENGINE_VARIANTS)
def engine(request: pytest.FixtureRequest, tiny_dir: str) -> Iterator[sgl.Engine]:
    e = sgl.Engine(tiny_dir, **request.param, skip_tokenizer_init=True, dtype="float32", max_total_tokens=4096,
                   max_running_requests=16, chunked_prefill_size=16)
    yield e
    assert_kv_balanced(e.get_server_info())
    e.shutdown()


_rng = random.Random(5)
PROMPT = [_rng.randrange(1, VOCAB - 1) for _ in range(40)]
IDS = [1, 5, 7]


def check_against_hf(out: dict[str, Any], prompt: list[int], start: int, hf: torch.Tensor) -> None:
    m, out_ids, n = out["meta_info"], out["output_ids"], len(prompt)
    got = m["output_token_logprobs"]
    assert [t for _, t, _ in got] == out_ids and all(text is None for _, _, text in got)
    want = hf[n - 1 : n - 1 + len(out_ids)].gather(1, torch.tensor(out_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([v for v, _, _ in got]), want, atol=TOL, rtol=0)
    top = hf[n - 1 : n - 1 + len(out_ids)].topk(3, dim=-1)
    torch.testing.assert_close(torch.tensor([[v for v, _, _ in row] for row in m["output_top_logprobs"]]), top.values,
                               atol=TOL, rtol=0)
    torch.testing.assert_close(torch.tensor([[v for v, _, _ in row] for row in m["output_token_ids_logprobs"]]),
                               hf[n - 1 : n - 1 + len(out_ids), IDS], atol=TOL, rtol=0)
    assert [[t for _, t, _ in row] for row in m["output_token_ids_logprobs"]] == [IDS] * len(out_ids)
    inp = m["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt[start:]
    vals = [v for v, _, _ in inp]
    if start == 0:
        assert vals[0] is None and m["input_top_logprobs"][0] is None
        vals = vals[1:]
    first = max(start, 1)
    want_in = hf[first - 1 : n - 1].gather(1, torch.tensor(prompt[first:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(vals), want_in, atol=TOL, rtol=0)
    tops = [row for row in m["input_top_logprobs"] if row is not None]
    assert len(tops) == n - first
    if tops:
        torch.testing.assert_close(torch.tensor([[v for v, _, _ in row] for row in tops]),
                                   hf[first - 1 : n - 1].topk(3, dim=-1).values, atol=TOL, rtol=0)


LP = {"return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": IDS}


def test_greedy_logprobs_equal_hf(engine: sgl.Engine, hf_model: Any) -> None:
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    out = engine.generate(input_ids=PROMPT, sampling_params=params, logprob_start_len=0, **LP)
    hf = hf_logprobs(hf_model, PROMPT + out["output_ids"])
    assert out["output_ids"] == hf[len(PROMPT) - 1 : -1].argmax(-1).tolist()  # greedy agrees with HF
    check_against_hf(out, PROMPT, 0, hf)
    # The prompt is cached now: prompt logprobs from position 10 still come back whole.
    again = engine.generate(input_ids=PROMPT, sampling_params=params, logprob_start_len=10, **LP)
    assert again["meta_info"]["cached_tokens"] <= 9
    check_against_hf(again, PROMPT, 10, hf)


def test_sampled_penalised_logprobs_are_of_the_raw_logits(engine: sgl.Engine, hf_model: Any) -> None:
    params = {"temperature": 1.3, "top_k": 40, "seed": 9, "max_new_tokens": 10, "ignore_eos": True,
              "frequency_penalty": 1.0, "repetition_penalty": 1.5, "logit_bias": {"3": 4.0}}
    chunks = list(engine.generate(input_ids=PROMPT[:20], sampling_params=params, stream=True, **LP))
    out = engine.generate(input_ids=PROMPT[:20], sampling_params=params, **LP)
    assert [t for c in chunks for t in c["output_ids"]] == out["output_ids"]
    m = out["meta_info"]
    assert [x for c in chunks for x in c["meta_info"]["output_token_logprobs"]] == m["output_token_logprobs"]
    assert m["input_token_logprobs"] == []  # logprob_start_len -1: output only
    hf = hf_logprobs(hf_model, PROMPT[:20] + out["output_ids"])
    check_against_hf(out, PROMPT[:20], 20, hf)


def test_penalised_greedy_equals_a_reference_loop_over_hf(engine: sgl.Engine, hf_model: Any) -> None:
    """The per-row output-token counts the runner keeps on the device match a plain loop."""
    pen = {"frequency_penalty": 0.7, "presence_penalty": 0.3, "repetition_penalty": 1.6}
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, **pen}
    prompts = [PROMPT[:9], PROMPT[3:30]]
    outs = engine.generate(
        input_ids=[*prompts, PROMPT[:5]],
        sampling_params=[params, params, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}],
    )
    for prompt, out in zip(prompts, outs):
        ids: list[int] = []
        for _ in range(12):
            with torch.inference_mode():
                row = hf_model(torch.tensor([prompt + ids])).logits[0, -1].float()
            row = row.clone()  # an ordinary tensor, writable outside inference mode
            for t in set(ids):
                x = row[t] / pen["repetition_penalty"] if row[t] > 0 else row[t] * pen["repetition_penalty"]
                row[t] = x - pen["frequency_penalty"] * ids.count(t) - pen["presence_penalty"]
            ids.append(int(row.argmax()))
        assert out["output_ids"] == ids
    plain = engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                                   "ignore_eos": True})
    assert plain["output_ids"] != outs[0]["output_ids"]  # the penalties changed something


def test_seeded_tokens_ignore_chunking_and_cache_hits(engine: sgl.Engine) -> None:
    params = {"temperature": 1.0, "seed": 21, "max_new_tokens": 8, "ignore_eos": True}
    prompt = PROMPT[5:38]  # 33 tokens: three prefill chunks of 16 when cold
    cold = engine.generate(input_ids=prompt, sampling_params=params)
    warm = engine.generate(input_ids=prompt, sampling_params=params)
    assert warm["meta_info"]["cached_tokens"] == len(prompt) - 1
    crowd = engine.generate(input_ids=[PROMPT[:7], prompt, PROMPT[9:30]],
                            sampling_params=[{"temperature": 1.0, "max_new_tokens": 8}, params, params])
    assert cold["output_ids"] == warm["output_ids"] == crowd[1]["output_ids"]


def test_prefill_only_request_returns_all_prompt_logprobs(engine: sgl.Engine, hf_model: Any) -> None:
    """max_new_tokens=0 with prompt logprobs (lm-eval-style scoring) runs the prefill, here
    in three chunks, outputs no token, and gives the prompt logprobs a one-token request gets."""
    prompt = PROMPT[2:37]
    one = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1},
                          logprob_start_len=0, **LP)
    zero = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, logprob_start_len=0, **LP)
    m0, m1 = zero["meta_info"], one["meta_info"]
    assert zero["output_ids"] == [] and m0["completion_tokens"] == 0
    assert m0["finish_reason"] == {"type": "length", "length": 0}
    assert m0["output_token_logprobs"] == m0["output_top_logprobs"] == m0["output_token_ids_logprobs"] == []
    assert len(m0["input_token_logprobs"]) == len(prompt)
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        assert m0[key] == m1[key], key
    hf = hf_logprobs(hf_model, prompt)
    want = hf[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([v for v, _, _ in m0["input_token_logprobs"][1:]]), want,
                               atol=TOL, rtol=0)

    # Streamed, beside a decoding request and as n = 2 samples sharing the prompt: the same lists.
    chunks = list(engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, stream=True,
                                  logprob_start_len=5, **LP))
    streamed = [x for c in chunks for x in c["meta_info"]["input_token_logprobs"]]
    assert [t for _, t, _ in streamed] == prompt[5:]  # a cache hit on the first 4 tokens moves the chunks
    torch.testing.assert_close(torch.tensor([v for v, _, _ in streamed]), want[4:], atol=TOL, rtol=0)
    mixed = engine.generate(input_ids=[PROMPT[:9], prompt], logprob_start_len=0, **LP, sampling_params=[
        {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}, {"max_new_tokens": 0, "n": 2}])
    assert len(mixed[0]["output_ids"]) == 6
    for out in mixed[1]:
        assert out["output_ids"] == []
        got = torch.tensor([v for v, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_prefill_only_request_without_prompt_logprobs_finishes_at_once(engine: sgl.Engine) -> None:
    before = engine.get_server_info()["prefill_tokens"]
    out = engine.generate(input_ids=PROMPT[:30], sampling_params={"max_new_tokens": 0}, **LP)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["input_token_logprobs"] == out["meta_info"]["output_token_logprobs"] == []
    assert engine.get_server_info()["prefill_tokens"] == before  # nothing to compute, so no prefill
