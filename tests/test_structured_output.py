"""Structured output through xgrammar on the default model (SmolLM2, float32, CPU):
for random JSON schemas (a Hypothesis strategy over objects, arrays, enums, strings
with patterns and bounds, numbers with bounds, booleans, nesting) every output,
greedy and sampled, parses and validates with `jsonschema`; for random regular
expressions every output is a `re.fullmatch`; EBNF too. A grammar that does not
compile is a ValueError naming the field; grammars work with n > 1, streaming, stop
strings, logprobs, beam search (each beam its own matcher: the beams equal a
reference beam search over the grammar's space, scored by HF on the same weights)
and through retraction (a small pool, on null weights with the
default model's tokenizer, where only the mask makes the output valid); aborting a
request while its grammar compiles leaves nothing behind. KV balances after each.
The OpenAI routes' structured output (response_format, regex, ebnf, bad grammars) is
checked through the real server in tests/test_openai_conformance_more.py."""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import sgl
from tests.conftest import assert_kv_balanced

NAMES = st.sampled_from(["id", "name", "tags", "score", "ok", "kind", "items", "size"])


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
        st.sampled_from([{"type": "string", "pattern": "^[a-z]{2,5}$"}, {"type": "string", "pattern": "^[0-9]{3}$"},
                         {"type": "boolean"}, {"type": "null"}]),
        st.lists(st.sampled_from(["red", "green", "blue", "x y"]), min_size=1, max_size=3, unique=True).map(
            lambda vals: {"enum": vals}),
    )


def _schema(depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    child = _leaf() if depth >= 1 else st.one_of(_leaf(), st.deferred(lambda: _schema(depth + 1)))
    obj = st.dictionaries(NAMES, child, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))
    arr = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, child, st.integers(1, 3))
    return obj if depth == 0 else st.one_of(obj, arr)


REGEXES = st.lists(st.sampled_from([r"[0-9]{2,4}", r"(yes|no)", r"[A-Z][a-z]{1,6}", r"-", r" ", r"\.", r"(ab){1,3}",
                                    r"[a-f0-9]{4}", r"(cat|dog|bird)s?"]), min_size=1, max_size=4).map("".join)


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    from sgl.sched.models.default_model import default_model_dir

    e = sgl.Engine(default_model_dir(), dtype="float32", transport="inproc", max_total_tokens=8000)
    yield e
    assert_kv_balanced(e.get_server_info())
    e.shutdown()


# No shrinking: each example runs the model; a failure prints its example and output as they are.
SETTINGS = settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(st.lists(_schema(), min_size=2, max_size=2), st.sampled_from([0.0, 0.8]))
def test_random_json_schemas_validate(engine: sgl.Engine, schemas: list[dict[str, Any]], temperature: float) -> None:
    prompts = [f"Reply with a JSON value for the schema {json.dumps(s)}:" for s in schemas]
    outs = engine.generate(prompts, [{"temperature": temperature, "max_new_tokens": 96, "seed": 1,
                                      "json_schema": json.dumps(s)} for s in schemas])
    for s, out in zip(schemas, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out  # the grammar completed
        jsonschema.validate(json.loads(out["text"]), s)


@SETTINGS
@given(st.lists(REGEXES, min_size=2, max_size=2), st.sampled_from([0.0, 0.8]))
def test_random_regexes_fullmatch(engine: sgl.Engine, patterns: list[str], temperature: float) -> None:
    outs = engine.generate([f"Write text matching /{p}/:" for p in patterns],
                           [{"temperature": temperature, "max_new_tokens": 48, "seed": 2, "regex": p}
                            for p in patterns])
    for p, out in zip(patterns, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(p, out["text"]), (p, out["text"])


def test_ebnf_n_stream_stop_and_logprobs(engine: sgl.Engine) -> None:
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    outs = engine.generate("Is the sky blue?", {"temperature": 0.9, "max_new_tokens": 16, "n": 3, "ebnf": grammar,
                                                 "seed": 3}, return_logprob=True)
    for o in outs:
        assert re.fullmatch(r"The answer is (yes|no)\.", o["text"]), o["text"]
        assert len(o["meta_info"]["output_token_logprobs"]) == o["meta_info"]["completion_tokens"]
    chunks = list(engine.generate("Is the sky blue?", {"temperature": 0, "max_new_tokens": 16, "ebnf": grammar},
                                  stream=True))
    assert re.fullmatch(r"The answer is (yes|no)\.", "".join(c["text"] for c in chunks))
    stopped = engine.generate("Is the sky blue?", {"temperature": 0, "max_new_tokens": 16, "ebnf": grammar,
                                                   "stop": " is"})
    assert stopped["text"] == "The answer" and stopped["meta_info"]["finish_reason"]["matched"] == " is"


@pytest.mark.parametrize("field, text", [("json_schema", "{not json"), ("regex", "(unclosed"),
                                         ("ebnf", "root ::= undefined_rule")])
def test_bad_grammar_is_a_value_error_naming_the_field(engine: sgl.Engine, field: str, text: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: the grammar does not compile"):
        engine.generate("x", {"max_new_tokens": 4, field: text})


def test_grammar_refusals_name_the_field(engine: sgl.Engine) -> None:
    for sp, field in [({"json_schema": "{}", "regex": "a"}, "regex"),
                      ({"regex": "a", "constraint": {"type": "trie", "sequences": [[1]]}}, "constraint")]:
        with pytest.raises(ValueError, match=field):
            engine.generate("x", sp)


def test_grammars_hold_through_retraction_on_null_weights(tmp_path: Any) -> None:
    """Null weights: the logits know nothing of the grammar, so only the mask makes
    these valid; a pool that cannot hold all of them at once makes retraction happen."""
    import asyncio

    model = _null_with_tokenizer(tmp_path)
    pattern = r"[0-9]{50,55}"  # single-digit tokens: 50 or more of them, so the requests outgrow their reserve

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with sgl.AsyncEngine(model, load_format="null", transport="inproc", max_total_tokens=200,
                                   chunked_prefill_size=16, disable_overlap_schedule=False) as e:
            outs = await asyncio.gather(*(e.generate(f"r {i}", {"temperature": 0.7, "seed": i, "max_new_tokens": 60,
                                                                 "regex": pattern}) for i in range(12)))
            aborted = asyncio.ensure_future(e.generate("x", {"max_new_tokens": 4, "json_schema": json.dumps(
                {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40)}})}))
            await asyncio.sleep(0)
            aborted.cancel()
            await asyncio.gather(aborted, return_exceptions=True)
            for _ in range(300):
                info = await e.get_server_info()
                if not info["running"] and not info["waiting"] and not info["grammars_compiling"]:
                    break
                await asyncio.sleep(0.02)
            return outs, info

    outs, info = asyncio.run(main())
    for o in outs:
        assert re.fullmatch(pattern, o["text"]), o["text"]
    assert info["retractions"] > 0
    assert_kv_balanced(info)



def _null_with_tokenizer(tmp_path: Any, vocab_size: int | None = None) -> str:
    """The default model's config and tokenizer, for null weights (only the mask shapes
    the output); `vocab_size`: the model's columns, padded past the tokenizer's ids."""
    import shutil

    from sgl.sched.models.default_model import default_model_dir

    src = default_model_dir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{src}/{f}", tmp_path / f)
    if vocab_size is not None:
        cfg = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab_size}))
    return str(tmp_path)


def test_columns_past_the_tokenizer_are_never_a_grammars_token(tmp_path: Any) -> None:
    """A model with more logits columns than its tokenizer has ids (Qwen3: 151,936 over
    151,669): the bitmasks cover the tokenizer's ids only (xgrammar slows 7x when the
    padding counts as special tokens), and the sampler keeps the columns past them out.
    Null weights give every other column the same logit, so sampling draws uniformly
    from what the mask leaves: 10,848 padding ids against a few dozen characters."""
    from transformers import AutoTokenizer

    from tests.test_scheduler_trust import Driver

    model = _null_with_tokenizer(tmp_path, vocab_size=60_000)
    tok = AutoTokenizer.from_pretrained(model)
    pattern = r"[a-z0-9 ]{20,40}"
    d = Driver(model, load_format="null", skip_tokenizer_init=False)
    for i in range(4):
        d.submit(f"r{i}", [10 + i, 20, 30], 50, regex=pattern, ignore_eos=False, temperature=1.0, seed=i)
    d.s.step()
    while d.s.grammars.pending:
        d.s.step()
    matched = [r for r in d.s.rids.values() if r.grammar is not None]
    assert len(matched) == 4 and {r.grammar_width for r in matched} == {len(tok)}
    d.run(max_steps=500)
    assert d.s.runner.vocab_size == 60_000
    assert {r["type"] for r in d.reasons.values()} == {"stop"}, d.reasons
    for ids in d.ids.values():
        assert max(ids) < len(tok), ids
        assert re.fullmatch(pattern, tok.decode(ids[:-1])), tok.decode(ids)
    d.balanced()


def test_a_grammar_of_no_text_is_refused_and_a_dead_end_ends_its_request(engine: sgl.Engine) -> None:
    """A grammar that compiles yet allows no first token (not even EOS) is the caller's
    ValueError; one that dead-ends after some output ends its request with an abort that
    says so (the token drawn under its empty mask is not called an internal error)."""
    with pytest.raises(ValueError, match=r"^regex: the grammar matches no text"):
        engine.generate("x", {"max_new_tokens": 4, "regex": r"[^\s\S]"})
    out = engine.generate("x", {"max_new_tokens": 4, "temperature": 0, "regex": r"ab[^\s\S]"})
    fin = out["meta_info"]["finish_reason"]
    assert fin["type"] == "abort" and fin["message"].startswith("regex: the grammar allows no token after"), fin
    assert out["text"].startswith("ab")
    # min_new_tokens bans the only end the grammar leaves: it ends there, with no token drawn outside it.
    for stream in (False, True):
        out = engine.generate("x", {"max_new_tokens": 8, "min_new_tokens": 4, "temperature": 0, "regex": r"ab"},
                              stream=stream)
        if stream:
            chunks = list(out)
            out = {"text": "".join(c["text"] for c in chunks), "meta_info": chunks[-1]["meta_info"]}
        fin = out["meta_info"]["finish_reason"]
        assert fin["type"] == "abort" and "min_new_tokens=4 bans the end" in fin["message"], fin
        assert out["text"] == "ab", out


def test_a_token_the_matcher_refuses_ends_that_request_alone(tmp_path: Any) -> None:
    """The matchers take each step's tokens on the mask thread, just before the next
    masks: a token a matcher refuses (its own mask allowed it, so an internal error)
    becomes an error on that request's row (its mask all-allowed: the token is
    dropped), and the other rows' matchers move on and fill their masks."""
    import torch
    import xgrammar
    from transformers import AutoTokenizer
    from xgrammar.testing import bitmask_to_bool_mask

    from sgl.core.sampling_params import SamplingParams
    from sgl.sched.grammar import _compiler_for
    from sgl.sched.req import Req
    from sgl.sched.runner.grammar_masks import GrammarRows, MaskFiller

    model = _null_with_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(model)
    eos = tok.eos_token_id
    compiled = _compiler_for(model, False, len(tok), (eos,))[0].compile_regex(r"[0-9]+")
    digit, letter = tok.convert_tokens_to_ids("7"), tok.convert_tokens_to_ids("a")
    reqs = [Req(f"r{i}", [1, 2], SamplingParams(max_new_tokens=8), False) for i in range(3)]
    for r in reqs:
        r.grammar = xgrammar.GrammarMatcher(compiled)
    reqs[0].output_ids = [digit]
    reqs[1].output_ids = [digit, letter, digit]  # three new tokens (a step sat out), the second refused
    reqs[2].output_ids = [letter]  # one new token, refused
    rows = GrammarRows(None, None, [4, 5, 6], reqs, [0, 0, 0], len(tok))
    fill = MaskFiller(torch.device("cpu"), frozenset([eos])).fill(rows)
    assert set(fill.errors) == {5, 6} and all(f"rejected token {letter}," in e for e in fill.errors.values())
    allowed = set(torch.nonzero(bitmask_to_bool_mask(fill.mask[0:1], len(tok))[0]).flatten().tolist())
    assert {eos, digit} <= allowed and letter not in allowed  # after a digit: more digits, or the end
    start = xgrammar.allocate_token_bitmask(1, len(tok))
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(start, 0)
    assert eos not in set(torch.nonzero(bitmask_to_bool_mask(start, len(tok))[0]).flatten().tolist())
    assert (fill.mask[1:] == -1).all()
    assert all(r.grammar_seen == len(r.output_ids) for r in reqs)


def test_one_grammar_for_many_requests_compiles_once(tmp_path: Any) -> None:
    """Requests of one grammar share its compile (a batch of one schema joins at once,
    not one compile at a time); aborting one of them while it compiles leaves the
    others theirs; a grammar seen before needs no compile at all."""
    from sgl.core.protocol import AbortReq
    from tests.test_scheduler_trust import Driver

    model = _null_with_tokenizer(tmp_path)
    d = Driver(model, load_format="null", skip_tokenizer_init=False)
    calls: list[tuple[str, str]] = []
    compile_ = d.s.grammars._compile
    d.s.grammars._compile = lambda kind, text: calls.append((kind, text)) or compile_(kind, text)  # type: ignore[method-assign]
    for i in range(12):
        d.submit(f"r{i}", [10 + i, 20, 30], 8, regex=r"[a-z]{8}" if i < 11 else r"[0-9]{8}")
    d.inbox.q.append(AbortReq("r0"))
    d.s.step()
    while d.s.grammars.pending:
        d.s.step()
    d.run(max_steps=2000)
    assert sorted(calls) == [("regex", r"[0-9]{8}"), ("regex", r"[a-z]{8}")]
    assert d.reasons.pop("r0")["type"] == "abort"
    assert {r["type"] for r in d.reasons.values()} <= {"length", "stop"} and len(d.reasons) == 11
    d.submit("again", [1, 2, 3], 8, regex=r"[a-z]{8}")
    d.s.step()
    while d.s.grammars.pending:
        d.s.step()
    d.run(max_steps=200)
    assert len(calls) == 2 and d.reasons["again"]["type"] in ("length", "stop")
    d.balanced()


def test_a_compile_alone_has_the_loop_wait_on_its_input(tmp_path: Any) -> None:
    """With nothing to run but a grammar compiling, the blocking loop waits on its input
    (GRAMMAR_POLL_S a turn) rather than polling it: a polling loop holds the GIL
    against the compile thread, whose tokenizer loading and imports are Python."""
    import threading

    from sgl.sched.scheduler import GRAMMAR_POLL_S
    from tests.test_scheduler_trust import Driver

    d = Driver(_null_with_tokenizer(tmp_path), load_format="null", skip_tokenizer_init=False)
    gate = threading.Event()
    compile_ = d.s.grammars._compile
    d.s.grammars._compile = lambda kind, text: gate.wait(30) and compile_(kind, text)  # type: ignore[method-assign]
    timeouts: list[float | None] = []
    recv = d.inbox.recv
    d.inbox.recv = lambda timeout=None: timeouts.append(timeout) or recv(timeout)  # type: ignore[method-assign]
    d.submit("r", [10, 20, 30], 4, regex=r"[a-z]{4}")
    d.s.step(block=True)  # takes the request: its compile starts and waits at the gate
    assert d.s.grammars.pending
    timeouts.clear()
    for _ in range(5):
        d.s.step(block=True)
    assert timeouts == [GRAMMAR_POLL_S] * 5
    gate.set()
    while d.s.grammars.pending:
        d.s.step(block=True)
    d.run(max_steps=200)
    assert d.reasons["r"]["type"] in ("length", "stop")
    d.balanced()


@pytest.mark.parametrize("where", ["start", "finish"])
def test_a_failing_mask_step_ends_its_batch_not_the_loop(tmp_path: Any, monkeypatch: Any, where: str) -> None:
    """Giving the matchers their tokens (`start`, on the scheduler's thread) or filling
    the masks (`finish` waits for the fill thread) raising once ends that batch's
    requests with an error; the loop goes on, later requests finish, KV balances."""
    from sgl.sched.runner.grammar_masks import MaskFiller
    from tests.test_scheduler_trust import Driver

    model = _null_with_tokenizer(tmp_path)
    d = Driver(model, load_format="null", skip_tokenizer_init=False, disable_overlap_schedule=False)
    real = getattr(MaskFiller, where)
    calls = {"n": 0}

    def flaky(self: MaskFiller, *a: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected mask failure")
        return real(self, *a)

    monkeypatch.setattr(MaskFiller, where, flaky)
    for i in range(3):  # single-digit tokens: 12 steps each, so the third mask step is theirs
        d.submit(f"r{i}", [10 + i, 20, 30], 12, regex=r"[0-9]{12}")
    d.s.step()
    while d.s.grammars.pending:
        d.s.step()
    d.run(max_steps=500)
    assert calls["n"] >= 3
    assert {r["type"] for r in d.reasons.values()} == {"abort"}, d.reasons
    assert all("injected mask failure" in r["message"] for r in d.reasons.values())
    d.submit("after", [1, 2, 3], 12, regex=r"[0-9]{12}")
    d.s.step()
    while d.s.grammars.pending:
        d.s.step()
    d.run(max_steps=500)
    assert d.reasons["after"]["type"] in ("length", "stop")
    d.balanced()


def test_length_bounded_strings_never_take_a_control_character(tmp_path: Any) -> None:
    """xgrammar 0.2.9 lets raw control characters into strings with minLength or
    maxLength, which JSON forbids (`json.loads` refuses them); the engine hands it those
    bounds as a pattern (sgl.sched.json_schema_rewrite). Inside such a string, through
    the engine's own compile, the mask allows no token holding a byte below 0x20, and
    still allows plain text and the closing quote."""
    import torch
    import xgrammar
    from xgrammar.testing import bitmask_to_bool_mask

    from sgl.sched.grammar import Grammars

    model = _null_with_tokenizer(tmp_path)
    grammars = Grammars(model, 49152, {0}, False)
    schema = {"type": "object", "required": ["title"], "additionalProperties": False,
              "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 40}}}
    compiled = grammars._compile("json_schema", json.dumps(schema))
    m = xgrammar.GrammarMatcher(compiled)
    assert m.accept_string('{"title": "ab')
    mask = xgrammar.allocate_token_bitmask(1, 49152)
    m.fill_next_token_bitmask(mask, 0)
    allowed = torch.nonzero(bitmask_to_bool_mask(mask, 49152)[0]).flatten().tolist()
    vocab = compiled.tokenizer_info.decoded_vocab
    control = [i for i in allowed if any(b < 0x20 for b in vocab[i])]
    assert not control, [vocab[i] for i in control[:10]]
    assert {vocab[i] for i in allowed} >= {b"c", b'"', b" the"}


def test_the_schema_rewrite_touches_bounded_plain_strings_only() -> None:
    from sgl.sched.json_schema_rewrite import for_xgrammar

    s = {"type": "object", "$defs": {"t": {"type": "string", "maxLength": 3}},
         "properties": {"enum": {"type": "string", "minLength": 2},  # a property named like a keyword
                        "p": {"type": "string", "pattern": "^a+$", "maxLength": 3},  # left to xgrammar
                        "e": {"enum": [{"type": "string", "maxLength": 3}]},  # data, not a schema
                        "l": {"type": "array", "items": [{"type": "string", "minLength": 1, "maxLength": 4}]}}}
    out = json.loads(for_xgrammar(json.dumps(s)))
    assert out["$defs"]["t"] == {"type": "string", "pattern": "^[\\s\\S]{0,3}$"}
    assert out["properties"]["enum"] == {"type": "string", "pattern": "^[\\s\\S]{2,}$"}
    assert out["properties"]["p"] == s["properties"]["p"] and out["properties"]["e"] == s["properties"]["e"]
    assert out["properties"]["l"]["items"] == [{"type": "string", "pattern": "^[\\s\\S]{1,4}$"}]
    assert for_xgrammar('{"type": "string"}') == '{"type": "string"}' and for_xgrammar("{bad") == "{bad"


def test_grammar_requests_keep_the_overlap_loop(tmp_path: Any) -> None:
    """Under overlap each loop turn launches the next step of a grammar request (its
    forward queued before the previous token is in the matcher, its mask after), so n
    tokens take about n turns, not the 2n of stepping serially; the tokens equal the
    same requests without overlap, and every output matches its regex."""
    from transformers import AutoTokenizer

    from tests.test_scheduler_trust import Driver

    model = _null_with_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(model)
    pattern = r"[a-z]{3}-[0-9]{30}"
    got = {}
    for overlap in (True, False):
        d = Driver(model, load_format="null", skip_tokenizer_init=False, disable_overlap_schedule=not overlap)
        for i in range(3):
            d.submit(f"r{i}", [10 + i, 20, 30], 40, regex=pattern, temperature=0.8, seed=i, ignore_eos=False)
        d.s.step()  # takes the requests in: they compile on the grammar thread, admitted once ready
        while d.s.grammars.pending:
            d.s.step()
        turns = d.run(max_steps=500)
        assert {r["type"] for r in d.reasons.values()} == {"stop"}
        assert all(re.fullmatch(pattern, tok.decode(ids[:-1])) for ids in d.ids.values()), d.ids
        got[overlap] = dict(d.ids)
        if overlap:  # a turn per token, a few more to start and end (serial steps took two per token)
            assert turns <= max(map(len, d.ids.values())) + 4, turns
        d.balanced()
    assert got[True] == got[False]


def _grammar_allowed(pattern: str, eos: list[int]) -> Any:
    """A generated prefix -> the ids the regex allows next (EOS once it may end), by xgrammar."""
    import torch
    import xgrammar
    from transformers import AutoTokenizer

    from sgl.sched.models.default_model import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    vocab = len(tok)
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    compiled = xgrammar.GrammarCompiler(info).compile_regex(pattern)

    def allowed(prefix: tuple[int, ...]) -> list[int]:
        m = xgrammar.GrammarMatcher(compiled)
        for t in prefix:
            assert m.accept_token(t)
        mask = xgrammar.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(mask, 0)
        bits = torch.zeros(1, vocab)
        xgrammar.apply_token_bitmask_inplace(bits, mask, vocab_size=vocab)
        return torch.nonzero(bits[0] == 0).flatten().tolist()

    return allowed


@pytest.mark.parametrize(("pattern", "width"), [(r"(cat|dog|bird)s? [0-9]{2}", 4), (r"[A-Z][a-z]{1,6}\.", 3)])
def test_beams_under_a_grammar_equal_the_reference(engine: sgl.Engine, pattern: str, width: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from sgl.sched.models.default_model import default_model_dir
    from tests.test_beam_trie_props import reference_beam_search

    eos = engine.get_server_info()["eos_token_ids"]
    prompt = engine.tokenizer.encode("Name an animal and a number:")
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def next_logprobs(prefixes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        for p in prefixes:
            if p not in cache:
                with torch.inference_mode():
                    cache[p] = torch.log_softmax(hf(torch.tensor([prompt + list(p)])).logits[0, -1].float(), -1)
        return [cache[p] for p in prefixes]

    max_new = 8
    ref = reference_beam_search(next_logprobs, _grammar_allowed(pattern, eos), frozenset(eos), width, max_new, 1.0,
                                False)
    assert ref.margin > 1e-3, "the reference's search hinges on a near tie: pick another prompt"
    got = engine.generate(input_ids=prompt, sampling_params={"beam_width": width, "num_return_beams": width,
                                                             "max_new_tokens": max_new, "regex": pattern})
    assert [tuple(b["output_ids"]) for b in got] == [h.ids for h in ref.beams]
    for b, h in zip(got, ref.beams):
        assert abs(b["meta_info"]["score"] - h.score) < 1e-4
        if b["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(pattern, b["text"]), b["text"]


def test_a_failed_mask_start_ends_its_requests_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlap: the step after a grammar step (the same requests) fails to start its masks
    while the grammar step's results are still to be applied. Those results must not reach
    the requests the failure ended: each ends once, with the abort, and no token after it."""
    from sgl.sched.runner.grammar_masks import MaskFiller
    from sgl.sched.scheduler import Scheduler
    from tests.test_scheduler_trust import Driver

    d = Driver(_null_with_tokenizer(tmp_path), load_format="null", skip_tokenizer_init=False,
               disable_overlap_schedule=False)
    eos = set(d.s.runner.eos_ids)
    start = MaskFiller.start
    raised: list[bool] = []

    def flaky(self: MaskFiller, g: Any, just: Any = None, background: bool = True) -> Any:
        if not raised and just and any(t in eos for t in just.values()):  # the step whose tokens end them
            raised.append(True)
            raise RuntimeError("injected mask failure")
        return start(self, g, just, background)

    ends: collections.Counter[str] = collections.Counter()
    finish = Scheduler.finish

    def counted(self: Scheduler, req: Any, reason: dict[str, Any]) -> None:
        ends[req.rid] += 1
        finish(self, req, reason)

    monkeypatch.setattr(MaskFiller, "start", flaky)
    monkeypatch.setattr(Scheduler, "finish", counted)
    for i in range(3):
        d.submit(f"r{i}", [10 + i, 20, 30], 10, regex=r"[0-9]{3}", ignore_eos=False)
    d.s.step()
    while d.s.grammars.pending:
        d.s.step()
    d.run(max_steps=200)
    assert raised and set(ends.values()) == {1}, ends
    assert {r["type"] for r in d.reasons.values()} == {"abort"}, d.reasons
    assert all(len(ids) == 3 for ids in d.ids.values()), dict(d.ids)  # the grammar's 3 digits, no EOS after
    d.balanced()
