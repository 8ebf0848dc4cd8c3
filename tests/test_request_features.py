"""Everything a request can ask for, end to end over every engine variant, on the
null model with SmolLM2's tokenizer (instant logits, real text): forced token
sequences through a custom logit processor, exact Unicode round trips streamed
or not, stop strings (trimmed, held back while streaming), min_new_tokens,
detokenize=False, n > 1 sharing the prompt's KV, validation errors at submit
time, one batch that mixes all of it, and streamed batches (chunks by index equal
the non-streamed results; leaving early aborts them all). KV accounting is
checked after each test."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sgl
from tests.conftest import ENGINE_VARIANTS

VOCAB = 49152
EOS = 2
FORCE = "force_tokens"
FORCE_PATH = "sgl.core.logit_processor:ForceTokens"


def null_next(t: int) -> int:
    return (t * 7 + 1) % VOCAB


def null_chain(last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = null_next(last)
        out.append(last)
    return out


@pytest.fixture(scope="module")
def tok_null_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The null model over SmolLM2's vocabulary, with its tokenizer files."""
    from sgl.sched.models.default_model import default_model_dir

    src = default_model_dir()
    d = tmp_path_factory.mktemp("null-tok")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 1024, "eos_token_id": EOS, "bos_token_id": 1}
    (d / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", d / name)
    return str(d)


@pytest.fixture(scope="module", params=ENGINE_VARIANTS)
def engine(request: pytest.FixtureRequest, tok_null_dir: str) -> Iterator[sgl.Engine]:
    e = sgl.Engine(tok_null_dir, **request.param, load_format="null", max_total_tokens=3000,
                   max_running_requests=32, custom_logit_processors=[FORCE, FORCE_PATH])
    yield e
    e.shutdown()


def forced(tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": len(tokens), "ignore_eos": True, "custom_params": {"tokens": tokens}, **extra}


def encode(engine: sgl.Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


# ---- forcing ids through the whole engine -----------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc", "Cn", "Co"]), min_size=1, max_size=30)
       | st.sampled_from([
           "😀🎉 ok", "日本語のテキスト", "e\u0301\u0302 combining",
           "👩‍👩‍👧 family", "mixed 中文 and ✓"]))
def test_forced_ids_round_trip_any_text(engine: sgl.Engine, text: str) -> None:
    ids = encode(engine, text)
    expected = engine.tokenizer.decode(ids)
    assert expected == text  # byte-level BPE round trips exactly
    out = engine.generate(input_ids=[5], sampling_params=forced(ids, temperature=1.0),
                          custom_logit_processor=FORCE)
    assert out["output_ids"] == ids and out["text"] == text
    chunks = list(engine.generate(input_ids=[5], sampling_params=forced(ids), custom_logit_processor=FORCE_PATH,
                                  stream=True))
    assert "".join(c["text"] for c in chunks) == text
    # No chunk streams a half-decoded character (a U+FFFD the text does not have there): every
    # prefix of the stream is a prefix of the text, which may hold U+FFFD itself.
    streamed = ""
    for c in chunks:
        streamed += c["text"]
        assert text.startswith(streamed), (streamed, text)


def test_forcing_one_request_leaves_its_batch_alone(engine: sgl.Engine) -> None:
    target = [100, 200, 300, 400, 500, 600]
    prompts = [[10 + i, 20 + i] for i in range(6)]
    params: list[dict[str, Any]] = [{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True} for _ in prompts]
    params[2] = forced(target, temperature=0)
    procs = [None, None, FORCE, None, None, None]
    outs = engine.generate(input_ids=prompts, sampling_params=params, custom_logit_processor=procs)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o["output_ids"] == (target if i == 2 else null_chain(p[-1], 6))


# ---- stop strings, stop ids, min_new_tokens -----------------------------------------


def test_stop_string_trims_and_is_never_streamed(engine: sgl.Engine) -> None:
    text = "Hello there, the end of it all"
    ids = encode(engine, text)
    params = forced(ids, stop=["the end", "never"])
    out = engine.generate(input_ids=[3], sampling_params=params, custom_logit_processor=FORCE)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "the end"}
    assert out["text"] == "Hello there, "
    assert len(out["output_ids"]) < len(ids)
    chunks = list(engine.generate(input_ids=[3], sampling_params=params, custom_logit_processor=FORCE, stream=True))
    assert "".join(c["text"] for c in chunks) == "Hello there, "
    kept = engine.generate(input_ids=[3], sampling_params={**params, "no_stop_trim": True},
                           custom_logit_processor=FORCE)
    assert kept["text"] == "Hello there, the end"


def test_stream_holds_back_a_possible_stop_until_resolved(engine: sgl.Engine) -> None:
    text = "abc the ending is not the end"
    ids = encode(engine, text)
    chunks = list(engine.generate(input_ids=[3], sampling_params=forced(ids, stop="the end."),
                                  custom_logit_processor=FORCE, stream=True))
    seen = ""
    for c in chunks[:-1]:
        seen += c["text"]
        assert not seen.endswith(("t", "th", "the", "the ", "the e", "the en", "the end")), seen
    assert seen + chunks[-1]["text"] == text  # never matched: everything comes out at the end
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_id_and_min_new_tokens(engine: sgl.Engine) -> None:
    pre = next(t for t in range(VOCAB) if null_next(t) == EOS)
    out = engine.generate(input_ids=[pre], sampling_params={"temperature": 0, "max_new_tokens": 5})
    assert out["output_ids"] == [EOS] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    out = engine.generate(input_ids=[pre], sampling_params={"temperature": 0, "max_new_tokens": 5,
                                                            "min_new_tokens": 3})
    ids = out["output_ids"]
    assert EOS not in ids[:3] and len(ids) >= 3
    cont = null_chain(9, 6)
    out = engine.generate(input_ids=[9], sampling_params={"temperature": 0, "max_new_tokens": 6,
                                                          "stop_token_ids": [cont[1]], "min_new_tokens": 2})
    assert cont[1] not in out["output_ids"][:2]


def test_detokenize_false_gives_ids_only(engine: sgl.Engine) -> None:
    ids = encode(engine, "some words here")
    out = engine.generate(input_ids=[4], sampling_params=forced(ids), custom_logit_processor=FORCE, detokenize=False)
    assert out["output_ids"] == ids and out["text"] == ""
    chunks = list(engine.generate(input_ids=[4], sampling_params=forced(ids), custom_logit_processor=FORCE,
                                  detokenize=False, stream=True))
    assert [t for c in chunks for t in c["output_ids"]] == ids and all(c["text"] == "" for c in chunks)


def test_special_tokens_skipped_or_kept(engine: sgl.Engine) -> None:
    ids = [*encode(engine, "hi"), 1, *encode(engine, " there")]  # 1 = <|im_start|>
    out = engine.generate(input_ids=[4], sampling_params=forced(ids), custom_logit_processor=FORCE)
    assert out["text"] == "hi there"
    out = engine.generate(input_ids=[4], sampling_params=forced(ids, skip_special_tokens=False),
                          custom_logit_processor=FORCE)
    assert out["text"] == "hi<|im_start|> there"


# ---- n > 1 ---------------------------------------------------------------------------


def test_n_samples_share_the_prompt(engine: sgl.Engine) -> None:
    prompt = list(range(40, 90))
    outs = engine.generate(input_ids=prompt, sampling_params={"n": 4, "max_new_tokens": 5, "ignore_eos": True,
                                                              "temperature": 1.0, "seed": 3})
    assert isinstance(outs, list) and len(outs) == 4
    assert all(len(o["output_ids"]) == 5 for o in outs)
    assert outs[0]["meta_info"]["cached_tokens"] < len(prompt) - 1  # the first prefilled it
    assert all(o["meta_info"]["cached_tokens"] == len(prompt) - 1 for o in outs[1:])
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # seed + i: different samples
    again = engine.generate(input_ids=prompt, sampling_params={"n": 4, "max_new_tokens": 5, "ignore_eos": True,
                                                               "temperature": 1.0, "seed": 3})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    chunks = list(engine.generate(input_ids=prompt, sampling_params={"n": 3, "max_new_tokens": 4, "temperature": 0,
                                                                     "ignore_eos": True}, stream=True))
    per = {i: [t for c in chunks if c["index"] == i for t in c["output_ids"]] for i in range(3)}
    assert per == {i: null_chain(prompt[-1], 4) for i in range(3)}


# ---- errors ----------------------------------------------------------------------------


def test_bad_requests_are_value_errors_naming_the_field(engine: sgl.Engine) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"custom_logit_processor": "os.system"}, "custom_logit_processor"),
        ({"sampling_params": {"logit_bias": {str(VOCAB): 1.0}}}, "logit_bias"),
        ({"sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
        ({"sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
        ({"return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
        ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"return_logprob": True, "token_ids_logprob": [VOCAB]}, "token_ids_logprob"),
        ({"no_such_option": 1}, "no_such_option"),
        # Wrong types would make the scheduler drop the frame and the request wait forever.
        ({"detokenize": "yes"}, "detokenize"),
        ({"return_logprob": True, "top_logprobs_num": True}, "top_logprobs_num"),
        ({"return_logprob": True, "token_ids_logprob": 5}, "token_ids_logprob"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            engine.generate(input_ids=[1, 2], **kwargs)
    # Still serving.
    assert engine.generate(input_ids=[1, 2], sampling_params={"temperature": 0, "max_new_tokens": 2,
                                                              "ignore_eos": True})["output_ids"] == null_chain(2, 2)


# ---- everything at once ----------------------------------------------------------------


def test_one_batch_mixing_everything(engine: sgl.Engine) -> None:
    stop_text = "one two three STOP four"
    stop_ids = encode(engine, stop_text)
    force_ids = encode(engine, "forced ✓")
    seeded = {"temperature": 0.8, "top_k": 50, "seed": 11, "max_new_tokens": 6, "ignore_eos": True}
    seeded_alone = engine.generate(input_ids=[7, 8], sampling_params=seeded)["output_ids"]
    prompts = [[5, 6], [7, 8], [30, 31, 32], [3], [12, 13, 14, 15], [4]]
    params: list[dict[str, Any]] = [
        {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
        seeded,
        {"n": 3, "temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        forced(stop_ids, stop="STOP"),
        {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True, "frequency_penalty": 0.5, "logit_bias": {"7": 0.1}},
        forced(force_ids),
    ]
    outs = engine.generate(input_ids=prompts, sampling_params=params,
                           custom_logit_processor=[None, None, None, FORCE, None, FORCE_PATH],
                           return_logprob=[False, False, False, False, True, False], top_logprobs_num=2,
                           logprob_start_len=[-1, -1, -1, -1, 0, -1])
    assert outs[0]["output_ids"] == null_chain(6, 5)
    assert outs[1]["output_ids"] == seeded_alone
    assert [o["output_ids"] for o in outs[2]] == [null_chain(32, 4)] * 3
    assert outs[3]["text"] == "one two three " and outs[3]["meta_info"]["finish_reason"]["matched"] == "STOP"
    m = outs[4]["meta_info"]
    assert outs[4]["output_ids"] == null_chain(15, 3)
    assert [t for _, t, _ in m["output_token_logprobs"]] == outs[4]["output_ids"]
    assert [t for _, t, _ in m["input_token_logprobs"]] == prompts[4] and m["input_token_logprobs"][0][0] is None
    assert len(m["output_top_logprobs"]) == 3 and all(len(row) == 2 for row in m["output_top_logprobs"])
    assert m["input_top_logprobs"][0] is None and len(m["input_top_logprobs"]) == 4
    assert outs[5]["text"] == "forced ✓"
    assert "output_token_logprobs" not in outs[0]["meta_info"]


def test_a_failing_processor_aborts_only_its_request(engine: sgl.Engine) -> None:
    outs = engine.generate(input_ids=[[5], [6]], sampling_params=[forced([VOCAB * 10]), forced([1, 2])],
                           custom_logit_processor=FORCE)
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "ForceTokens failed" in outs[0]["meta_info"]["finish_reason"]["message"]
    assert outs[1]["output_ids"] == [1, 2]


def test_logprob_texts_on_request(engine: sgl.Engine) -> None:
    ids = encode(engine, "Hi there")
    out = engine.generate(input_ids=encode(engine, "Say"), sampling_params=forced(ids),
                          custom_logit_processor=FORCE, return_logprob=True, top_logprobs_num=1,
                          return_text_in_logprobs=True, logprob_start_len=0)
    m = out["meta_info"]
    assert "".join(text for _, _, text in m["output_token_logprobs"]) == "Hi there"
    # Raw logits (the null model's one-hot), not the forced distribution (which would give 0).
    cold = -math.log(math.e + VOCAB - 1)
    assert all(v == pytest.approx(cold, abs=1e-4) for v, _, _ in m["output_token_logprobs"])
    assert [t for _, t, _ in m["input_token_logprobs"]] == encode(engine, "Say")
    assert all(isinstance(row[0][2], str) for row in m["output_top_logprobs"])


def test_generation_config_defaults_fill_unset_fields(tmp_path: Any, tok_null_dir: str) -> None:
    from sgl.runtime.req_options import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": None,
                                                                 "do_sample": True, "max_length": 20}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9}
    assert generation_defaults(tok_null_dir) == {}
    shutil.copy(tmp_path / "generation_config.json", f"{tok_null_dir}/generation_config.json")
    try:
        e = sgl.Engine(tok_null_dir, transport="inproc", load_format="null", max_total_tokens=200)
        try:
            assert e._engine.tm.defaults == {"temperature": 0.6, "top_p": 0.9}
            out = e.generate(input_ids=[5], sampling_params={"temperature": 0, "max_new_tokens": 2, "ignore_eos": True})
            assert out["output_ids"] == null_chain(5, 2)  # explicit fields win
        finally:
            e.shutdown()
    finally:
        (tmp_path / "gc").mkdir()
        shutil.move(f"{tok_null_dir}/generation_config.json", tmp_path / "gc" / "generation_config.json")


def test_an_unimportable_allowed_processor_fails_the_start(tok_null_dir: str) -> None:
    with pytest.raises(ValueError, match="custom_logit_processor='no.such.module:Thing'"):
        sgl.Engine(tok_null_dir, transport="inproc", load_format="null", max_total_tokens=200,
                   custom_logit_processors=["no.such.module:Thing"])


def test_aborting_an_n_request_aborts_every_sample(engine: sgl.Engine) -> None:
    it = engine.generate(input_ids=[7, 8], sampling_params={"n": 2, "max_new_tokens": 900, "ignore_eos": True},
                         stream=True, rid="many")
    first = next(it)
    assert first["meta_info"]["id"] in ("many-0", "many-1")
    engine.abort("many")
    reasons = [c["meta_info"]["finish_reason"] for c in it if c["meta_info"]["finish_reason"]]
    assert [r["type"] for r in reasons] == ["abort", "abort"]


# ---- streamed batches ------------------------------------------------------------------


def by_index(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    per: dict[int, list[dict[str, Any]]] = {}
    for c in chunks:
        per.setdefault(c["index"], []).append(c)
    return per


def assert_stream_matches(per: list[dict[str, Any]], out: dict[str, Any]) -> None:
    """One index's chunks add up to the non-streamed result; only the last has a finish_reason."""
    assert [t for c in per for t in c["output_ids"]] == out["output_ids"]
    assert "".join(c["text"] for c in per) == out["text"]
    assert [c["meta_info"]["finish_reason"] for c in per[:-1]] == [None] * (len(per) - 1)
    assert per[-1]["meta_info"]["finish_reason"] == out["meta_info"]["finish_reason"]
    lps = [t for c in per for t in c["meta_info"].get("output_token_logprobs", [])]
    assert lps == out["meta_info"].get("output_token_logprobs", [])


def test_streamed_batch_equals_the_generated_batch(engine: sgl.Engine) -> None:
    prompts = [[5, 6], [7], [30, 31, 32]]
    params: list[dict[str, Any]] = [{"temperature": 0, "max_new_tokens": k, "ignore_eos": True} for k in (6, 2, 4)]
    kw: dict[str, Any] = {"input_ids": prompts, "sampling_params": params, "return_logprob": [True, False, True],
                          "return_text_in_logprobs": True}
    outs = engine.generate(**kw)
    chunks = list(engine.generate(**kw, stream=True, rid=["b0", "b1", "b2"]))
    per = by_index(chunks)
    assert sorted(per) == [0, 1, 2]
    for i, out in enumerate(outs):
        assert out["output_ids"] == null_chain(prompts[i][-1], params[i]["max_new_tokens"])
        assert {c["meta_info"]["id"] for c in per[i]} == {f"b{i}"}
        assert_stream_matches(per[i], out)


def test_streamed_batch_with_n_numbers_choices_prompt_major(engine: sgl.Engine) -> None:
    sp = {"n": 2, "temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    prompts = ["Hello there", "Bye", "One two three"]
    outs = engine.generate(prompts, sp)
    per = by_index(list(engine.generate(prompts, sp, stream=True)))
    assert sorted(per) == list(range(6))
    for k, chunks in per.items():  # index = prompt_index * n + sample_index
        assert_stream_matches(chunks, outs[k // 2][k % 2])
    # Prompts with different n: each prompt's indices follow the samples of those before it.
    mixed = [{**sp, "n": 3}, {**sp, "n": 1}, sp]
    outs = engine.generate(prompts, mixed)
    flat = [outs[0][0], outs[0][1], outs[0][2], outs[1], outs[2][0], outs[2][1]]
    per = by_index(list(engine.generate(prompts, mixed, stream=True)))
    assert sorted(per) == list(range(6))
    for k, chunks in per.items():
        assert_stream_matches(chunks, flat[k])


def test_streamed_batch_interleaves_and_leaving_early_aborts_all(engine: sgl.Engine) -> None:
    long = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}
    params = [long, {**long, "max_new_tokens": 2}, {**long, "n": 2}]
    it = engine.generate(input_ids=[[4], [5], [6]], sampling_params=params, stream=True)
    finished = []
    for c in it:  # the short prompt finishes while the long ones still run: chunks arrive as they come
        if c["meta_info"]["finish_reason"] is not None:
            finished.append(c["index"])
            break
    assert finished == [1]
    it.close()


def test_streamed_batch_async_and_errors(engine: sgl.Engine) -> None:
    async def main() -> None:
        sp = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
        stream = await engine.async_generate(input_ids=[[8], [9]], sampling_params=sp, stream=True)
        per = by_index([c async for c in stream])
        assert {i: [t for c in cs for t in c["output_ids"]] for i, cs in per.items()} == \
            {0: null_chain(8, 3), 1: null_chain(9, 3)}

    asyncio.run(main())
    with pytest.raises(ValueError, match="sampling_params"):  # at the call, not at the first chunk
        engine.generate(input_ids=[[1], [2]], sampling_params=[{}], stream=True)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate(input_ids=[[1], [2]], top_logprobs_num=[1, 2, 3], stream=True)
    # A bad prompt fails the stream before any chunk, and its good sibling is aborted.
    with pytest.raises(ValueError, match="input_ids"):
        next(engine.generate(input_ids=[[1, 2], [VOCAB]], sampling_params={"max_new_tokens": 500}, stream=True))
