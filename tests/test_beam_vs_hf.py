"""Native beam search against Hugging Face transformers on the default model
(SmolLM2-135M-Instruct, float32, CPU): for a few short prompts and widths 1, 4 and 8,
the beams sgl returns (a batch of prompts in one call) are HF `generate(num_beams=W,
num_return_sequences=W, do_sample=False)`'s sequences, in HF's order, with HF's
`sequences_scores` within 1e-4: with EOS banned (min_new_tokens = max_new_tokens on
both sides) and with EOS allowed, early_stopping False and True, length_penalty 1.0,
0.5 and 2.0. HF runs one prompt at a time without padding; width 1 is HF's greedy
search (which HF's beam rules reduce to), scored from its raw logits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import sgl
from tests.conftest import assert_kv_balanced

TOL = 1e-4
NEW_TOKENS = 8
EOS = 2  # SmolLM2's eos_token_id, also its pad_token_id (what HF pads finished beams with)
CHAT = ["What is 2+2? Reply with one number.", "Say hi."]  # short answers: EOS inside 8 tokens

# (id, prompts (indices into the prompt list), widths, EOS banned, early_stopping, length_penalty)
Case = tuple[str, tuple[int, ...], tuple[int, ...], bool, bool, float]
CASES: list[Case] = [
    ("no-eos", (0, 1), (1, 4), True, False, 1.0),
    ("no-eos", (0,), (8,), True, False, 1.0),
    ("eos", (1, 2), (1, 4, 8), False, False, 1.0),
    ("eos-early", (2,), (4,), False, True, 1.0),
    ("eos-lp2", (1,), (4,), False, False, 2.0),
    ("eos-early-lp0.5", (1,), (4,), False, True, 0.5),
]
PARAMS = [pytest.param(c[1], w, *c[3:], id=f"{c[0]}-w{w}") for c in CASES for w in c[2]]

HfBeams = list[tuple[list[int], float]]  # (generated ids, score), best first


@pytest.fixture(scope="module")
def smollm_dir() -> str:
    from sgl.sched.models.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def prompts(smollm_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    texts = ["The capital of France is"] + [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in CHAT]
    return [tok(t).input_ids for t in texts]


@pytest.fixture(scope="module")
def hf(smollm_dir: str) -> Callable[[list[int], int, bool, bool, float], HfBeams]:
    """HF's beams for (prompt, width, EOS banned, early_stopping, length_penalty), cached."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    cache: dict[tuple[Any, ...], HfBeams] = {}

    def run(ids: list[int], width: int, ban_eos: bool, early: bool, lp: float) -> HfBeams:
        key = (tuple(ids), width, ban_eos, early, lp)
        if key not in cache:
            cache[key] = hf_beams(model, ids, width, ban_eos, early, lp)
        return cache[key]

    return run


def hf_beams(model: Any, ids: list[int], width: int, ban_eos: bool, early: bool, lp: float) -> HfBeams:
    x = torch.tensor([ids])
    n = len(ids)
    kw: dict[str, Any] = dict(attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                              min_new_tokens=NEW_TOKENS if ban_eos else 0, return_dict_in_generate=True,
                              eos_token_id=EOS, pad_token_id=EOS)
    with torch.inference_mode():
        if width == 1:  # HF runs greedy search for num_beams=1; its beam rules pick the same tokens
            out = model.generate(x, num_beams=1, output_logits=True, **kw)
            gen = out.sequences[0, n:].tolist()
            cum = sum(float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, gen))
            return [(gen, cum / len(gen) ** lp)]
        out = model.generate(x, num_beams=width, num_return_sequences=width, output_scores=True,
                             length_penalty=lp, early_stopping=early, **kw)
    # Each beam's generated length: the steps its beam_indices record (-1 after it ended).
    lens = (out.beam_indices != -1).sum(dim=1).tolist()
    beams: HfBeams = []
    for i, k in enumerate(lens):
        row = out.sequences[i].tolist()
        gen, tail = row[n:n + k], row[n + k:]
        assert all(t == EOS for t in tail), f"HF's padding after beam {i} is not {EOS}: {tail}"
        assert k == NEW_TOKENS or gen[-1] == EOS, f"HF's beam {i} ended early without EOS: {gen}"
        beams.append((gen, float(out.sequences_scores[i])))
    return beams


@pytest.fixture(scope="module")
def engine(smollm_dir: str) -> Iterator[sgl.Engine]:
    e = sgl.Engine(smollm_dir, transport="inproc", dtype="float32", max_total_tokens=4096, max_running_requests=32)
    yield e
    assert_kv_balanced(e.get_server_info())
    e.shutdown()


def beam_params(width: int, ban_eos: bool, early: bool, lp: float, **kw: Any) -> dict[str, Any]:
    return {"beam_width": width, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS if ban_eos else 0,
            "temperature": 0, "early_stopping": early, "length_penalty": lp, **kw}


def assert_beams_equal(got: list[dict[str, Any]], want: HfBeams, lp: float, tok: Any, what: str) -> None:
    got_ids = [b["output_ids"] for b in got]
    assert got_ids == [ids for ids, _ in want], f"{what}: sgl beams {got_ids} != HF {[ids for ids, _ in want]}"
    for k, (b, (ids, score)) in enumerate(zip(got, want)):
        m = b["meta_info"]
        assert abs(m["score"] - score) <= TOL, f"{what} beam {k}: score {m['score']} != HF {score}"
        assert m["score"] == pytest.approx(m["cumulative_logprob"] / len(ids) ** lp, abs=1e-5, rel=1e-5), m
        assert m["finish_reason"]["type"] == ("stop" if ids[-1] == EOS else "length"), (what, k, m)
        assert b["text"] == tok.decode(ids, skip_special_tokens=True), (what, k)


@pytest.mark.parametrize(("which", "width", "ban_eos", "early", "lp"), PARAMS)
def test_beams_equal_hf(engine: sgl.Engine, prompts: list[list[int]], hf: Callable[..., HfBeams],
                        which: tuple[int, ...], width: int, ban_eos: bool, early: bool, lp: float) -> None:
    batch = [prompts[i] for i in which]
    outs = engine.generate(input_ids=batch, sampling_params=beam_params(width, ban_eos, early, lp))
    assert isinstance(outs, list) and len(outs) == len(batch)
    for i, ids, got in zip(which, batch, outs):
        want = hf(ids, width, ban_eos, early, lp)
        assert isinstance(got, list) and len(got) == width, f"prompt {i}: {len(got)} beams for width {width}"
        assert_beams_equal(got, want, lp, engine.tokenizer, f"prompt {i}")
        if ban_eos:
            assert all(len(b["output_ids"]) == NEW_TOKENS and EOS not in b["output_ids"] for b in got)


def test_num_return_beams_is_the_best_prefix(engine: sgl.Engine, prompts: list[list[int]],
                                             hf: Callable[..., HfBeams]) -> None:
    """One prompt (not a batch) gives one list of beams: the best num_return_beams of HF's."""
    got = engine.generate(input_ids=prompts[1], sampling_params=beam_params(4, False, False, 1.0, num_return_beams=2))
    assert_beams_equal(got, hf(prompts[1], 4, False, False, 1.0)[:2], 1.0, engine.tokenizer, "num_return_beams=2")
