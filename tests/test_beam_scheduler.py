"""Beam search inside the scheduler, on a tiny random llama in float32 (exact
arithmetic against Hugging Face): a per-beam processor that reads each beam's own
output ids equals HF's beam search with the same processor (so the ids follow the
beams when they fork); beams under concurrency, chunked prefill, the CPU overlap
worker and retraction equal the same requests run one by one; aborted beam
requests give back every slot and row; a trie constrains plain greedy decoding too,
through retraction."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import sgl
from sgl.core.logit_processor import BEAM_KEY, OUTPUT_IDS_KEY, CustomLogitProcessor
from sgl.core.protocol import BatchTokenIDOutput, GenerateReqInput
from sgl.core.sampling_params import SamplingParams
from tests.conftest import assert_kv_balanced, tiny_model_dir

V = 40
EOS = V - 1
NO_REPEAT = "tests.test_beam_scheduler:NoRepeat"


class NoRepeat(CustomLogitProcessor):
    """Bans each beam's last output token (needs the beam's own ids)."""

    needs_output_ids = True

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]]) -> torch.Tensor:
        for i, p in enumerate(params):
            assert BEAM_KEY in p
            if p[OUTPUT_IDS_KEY]:
                logits[i, p[OUTPUT_IDS_KEY][-1]] = float("-inf")
        return logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("beam-model"), "llama", V, seed=2)


def beams_of(out: list[dict[str, Any]]) -> list[tuple[list[int], float]]:
    return [(b["output_ids"], round(b["meta_info"]["score"], 4)) for b in out]


def test_per_beam_processor_equals_hf(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class HFNoRepeat(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            gen = input_ids[:, prompt_len:]
            if gen.shape[1]:
                scores = scores.clone()
                scores[torch.arange(scores.shape[0]), gen[:, -1]] = float("-inf")
            return scores

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = sgl.Engine(model_dir, skip_tokenizer_init=True, dtype="float32", transport="inproc",
                        custom_logit_processors=[NO_REPEAT], max_total_tokens=2000)
    try:
        for prompt in ([5, 17, 33, 2], [9, 9, 30, 1, 1]):
            prompt_len = len(prompt)
            ref = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, do_sample=False,
                              max_new_tokens=7, min_new_tokens=7, output_scores=True, return_dict_in_generate=True,
                              logits_processor=LogitsProcessorList([HFNoRepeat()]), pad_token_id=EOS,
                              eos_token_id=EOS)
            out = engine.generate(input_ids=prompt, custom_logit_processor=NO_REPEAT,
                                  sampling_params={"beam_width": 4, "max_new_tokens": 7, "min_new_tokens": 7})
            ours = [b["output_ids"] for b in out]
            assert ours == [s[prompt_len:].tolist() for s in ref.sequences]
            assert [b["meta_info"]["score"] for b in out] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
            assert all(a != b for ids in ours for a, b in zip(ids, ids[1:]))  # the ban held on every beam
        assert_kv_balanced(engine.get_server_info())
    finally:
        engine.shutdown()


def _requests(seed: int) -> list[tuple[list[int], dict[str, Any]]]:
    rng = random.Random(seed)
    out: list[tuple[list[int], dict[str, Any]]] = []
    for i in range(24):
        prompt = [rng.randrange(EOS) for _ in range(rng.randint(3, 30))]
        if i % 3 == 0:
            sp: dict[str, Any] = {"temperature": 0, "max_new_tokens": rng.randint(1, 12)}
        else:
            sp = {"beam_width": rng.choice([1, 2, 4, 8]), "max_new_tokens": rng.randint(1, 10),
                  "length_penalty": rng.choice([0.5, 1.0, 2.0]), "early_stopping": rng.choice([False, True, "never"])}
        if i % 4 == 1:
            seqs = [[rng.randrange(EOS) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 6))]
            sp["constraint"] = {"type": "trie", "sequences": seqs}
        out.append((prompt, sp))
    return out


async def _run(model_dir: str, reqs: list[tuple[list[int], dict[str, Any]]], one_by_one: bool,
               **kw: Any) -> tuple[list[Any], dict[str, Any]]:
    async with sgl.AsyncEngine(model_dir, skip_tokenizer_init=True, dtype="float32", transport="inproc",
                               **kw) as e:
        if one_by_one:
            outs = [await e.generate(input_ids=p, sampling_params=sp) for p, sp in reqs]
        else:
            outs = await asyncio.gather(*[e.generate(input_ids=p, sampling_params=sp) for p, sp in reqs])
        return outs, await e.get_server_info()


def _key(out: Any) -> Any:
    return beams_of(out) if isinstance(out, list) else out["output_ids"]


def _in_trie(ids: list[int], seqs: list[list[int]], max_new: int) -> bool:
    if ids and ids[-1] == EOS:
        return ids[:-1] in seqs
    return len(ids) == max_new and any(q[: len(ids)] == ids for q in seqs)


@pytest.mark.parametrize("kw", [
    {"max_total_tokens": 4000, "disable_overlap_schedule": False, "chunked_prefill_size": 16},
    {"max_total_tokens": 112, "chunked_prefill_size": 8},  # a pool each request just fits alone
    {"max_total_tokens": 112, "disable_overlap_schedule": False},
], ids=["overlap-chunked", "small-pool", "small-pool-overlap"])
def test_concurrent_beams_equal_one_by_one(model_dir: str, kw: dict[str, Any]) -> None:
    reqs = _requests(0)
    alone, _ = asyncio.run(_run(model_dir, reqs, True, max_total_tokens=4000))
    together, info = asyncio.run(_run(model_dir, reqs, False, **kw))
    assert [_key(o) for o in together] == [_key(o) for o in alone]
    assert_kv_balanced(info)
    for (_, sp), out in zip(reqs, alone):
        if "constraint" in sp:
            seqs = sp["constraint"]["sequences"]
            for ids in ([b["output_ids"] for b in out] if isinstance(out, list) else [out["output_ids"]]):
                assert _in_trie(ids, seqs, sp["max_new_tokens"]), (ids, seqs)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("after_steps", [1, 2, 5])
def test_retracted_beam_request_comes_back_whole(model_dir: str, overlap: bool, after_steps: int) -> None:
    """Retracted mid-search (its prefill done, beams forked, a step maybe in flight),
    a beam request starts over and returns the same beams; KV balances."""
    from tests.test_scheduler_trust import Driver

    def run(retract_at: int | None) -> list[tuple[list[int], float]]:
        d = Driver(model_dir, max_total_tokens=500, disable_overlap_schedule=not overlap)
        sp = SamplingParams(beam_width=4, max_new_tokens=8, min_new_tokens=8, temperature=0)
        d.inbox.q.append(GenerateReqInput("b", [3, 1, 4, 1, 5], sp))
        got: list[tuple[list[int], float]] = []
        for i in range(200):
            if i == retract_at and "b" in d.s.rids:
                d.s.decode.retract(d.s.rids["b"])
                assert d.s.info()["retractions"] == 1
            d.s.step()
            for m in d.out.msgs:
                if isinstance(m, BatchTokenIDOutput):
                    for beams in m.beams:
                        got += [(b.output_ids, round(b.score, 4)) for b in beams or ()]
            d.out.msgs.clear()
            if got:
                break
        d.balanced()
        return got

    assert run(after_steps + 1) == run(None)


def test_aborted_beams_give_everything_back(model_dir: str) -> None:
    async def main() -> None:
        async with sgl.AsyncEngine(model_dir, skip_tokenizer_init=True, dtype="float32", transport="inproc",
                                   max_total_tokens=3000, disable_overlap_schedule=False, context_length=1000) as e:
            long = {"beam_width": 8, "max_new_tokens": 300, "min_new_tokens": 300}
            tasks = [asyncio.create_task(e.generate(input_ids=[i + 1, 2, 3], sampling_params=long)) for i in range(3)]
            for _ in range(500):
                if (await e.get_server_info())["running"] == 3:
                    break
                await asyncio.sleep(0.01)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            done = await e.generate(input_ids=[4, 5], sampling_params={"beam_width": 2, "max_new_tokens": 3})
            assert len(done) == 2
            for _ in range(500):
                info = await e.get_server_info()
                if info["running"] == 0 and info["waiting"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert_kv_balanced(info)

    asyncio.run(main())


def test_rejected_beam_requests_name_the_field(model_dir: str) -> None:
    engine = sgl.Engine(model_dir, skip_tokenizer_init=True, dtype="float32", transport="inproc",
                        max_total_tokens=200, max_running_requests=8)
    try:
        trie = {"type": "trie", "sequences": [[V + 3]]}
        cases = [({"beam_width": 16}, "beam_width"), ({"beam_width": 4, "max_new_tokens": 60}, "beam_width"),
                 ({"beam_width": 2, "temperature": 0.7}, "temperature"),
                 ({"beam_width": 2, "max_new_tokens": 4, "constraint": trie}, "constraint"),
                 ({"beam_width": 2, "max_new_tokens": 4, "constraint": {"type": "trie", "name": "never-sent"}},
                  "constraint.name")]
        for sp, field in cases:
            with pytest.raises(ValueError, match=field):
                out = engine.generate(input_ids=[1, 2], sampling_params=sp)
                # A kept trie's name is only known to the scheduler: it answers with an abort.
                reason = out[0]["meta_info"]["finish_reason"]
                if reason["type"] == "abort":
                    raise ValueError(reason["message"])
        assert_kv_balanced(engine.get_server_info())
    finally:
        engine.shutdown()


def test_named_trie_is_kept(model_dir: str, tmp_path: Path) -> None:
    engine = sgl.Engine(model_dir, skip_tokenizer_init=True, dtype="float32", transport="inproc",
                        max_total_tokens=2000)
    try:
        seqs = [[3, 4, 5], [3, 7], [8]]
        first = engine.generate(input_ids=[1, 2], sampling_params={
            "beam_width": 3, "max_new_tokens": 4, "constraint": {"type": "trie", "sequences": seqs, "name": "t"}})
        again = engine.generate(input_ids=[1, 2], sampling_params={
            "beam_width": 3, "max_new_tokens": 4, "constraint": {"type": "trie", "name": "t"}})
        assert beams_of(first) == beams_of(again)
        assert {tuple(b["output_ids"]) for b in first} == {(3, 4, 5, EOS), (3, 7, EOS), (8, EOS)}
    finally:
        engine.shutdown()
