"""Hypothesis strategies for what an app sends an sgl engine: sampling parameters (valid
ones, within the documented bounds and in combinations the engine accepts; invalid
ones, each with the name of the field the engine's ValueError names), prompts (text
and token ids), whole generate requests (`GenerateRequest`), OpenAI chat messages and
function tools, JSON schemas the engine's grammar backend compiles (and their
instances, through hypothesis-jsonschema) and regular expressions.

Every strategy is bounded by a `Limits`: the engine's own (vocabulary, context, KV
pool; `Limits.from_server_info`) and the sizes a test keeps its requests to. It
imports neither torch nor transformers, and never talks to an engine."""

from __future__ import annotations

import dataclasses
import json
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from sgl.core.request_checks import MAX_TOKEN_IDS_LOGPROB
from sgl.core.sampling_params import (
    MAX_BEAM_WIDTH,
    MAX_N,
    MAX_STOP_STR_CHARS,
    MAX_STOP_STRS,
    MAX_STOP_TOKEN_IDS,
)
from sgl.testing._request import GenerateRequest

__all__ = ["GenerateRequest", "InvalidRequest", "Limits", "beam_sampling_params", "chat_messages", "generate_requests",
           "invalid_requests", "invalid_sampling_params", "json_instances", "json_schemas", "plain_sampling_params",
           "prompts", "regexes", "request_options", "sampling_params", "stop_strings", "text_prompts", "token_ids",
           "tools"]

Draw = Any  # hypothesis's draw function inside @st.composite


@dataclass(frozen=True)
class Limits:
    """The bounds of drawn requests: the engine's limits, then the sizes a test keeps its
    requests to (small on a CPU: every drawn token is decoded)."""

    vocab_size: int = 1000
    context_length: int = 2048
    max_total_tokens: int = 4096
    has_tokenizer: bool = True  # text prompts and stop strings need one
    grammars: bool = True  # json_schema and regex requests (a grammar backend and a tokenizer)
    max_top_logprobs_num: int = 20
    max_running_requests: int = 16
    max_new_tokens: int = 16
    max_prompt_tokens: int = 16
    max_prompt_chars: int = 24
    max_n: int = 3
    max_beam_width: int = 3
    max_batch: int = 3

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any], *, has_tokenizer: bool, **sizes: Any) -> Limits:
        """The limits of the engine whose `get_server_info()` is `info`; `sizes` set the
        test's own bounds (max_new_tokens, max_batch, ..., and grammars)."""
        sizes.setdefault("grammars", has_tokenizer)
        return cls(vocab_size=info["vocab_size"], context_length=info["context_length"],
                   max_total_tokens=info["max_total_tokens"], has_tokenizer=has_tokenizer,
                   max_top_logprobs_num=info.get("max_top_logprobs_num", 20),
                   max_running_requests=info.get("max_running_requests", MAX_BEAM_WIDTH), **sizes)

    def replace(self, **changes: Any) -> Limits:
        return dataclasses.replace(self, **changes)

    @property
    def text_prompt_tokens(self) -> int:
        """A bound on a text prompt's length in tokens: a token holds at least one UTF-8
        byte, plus a few special tokens the tokenizer may add."""
        return 4 * self.max_prompt_chars + 8

    def new_token_cap(self, prompt_tokens: int, width: int = 1) -> int:
        """The most new tokens a drawn request asks for: the test's bound, within the
        context and the KV pool (a beam request holds `width` rows)."""
        room = min(self.context_length - prompt_tokens, (self.max_total_tokens - prompt_tokens) // max(width, 1))
        return max(0, min(self.max_new_tokens, room))


# ---- prompts -------------------------------------------------------------------------

_PHRASES = ["Hello", "The capital of France is", "Count to five:", "Write a haiku about the sea.", "1, 2, 3,",
            "Q: What is 2 + 2?\nA:", "Once upon a time", "def add(a, b):"]


def token_ids(limits: Limits, min_size: int = 1, max_size: int | None = None) -> st.SearchStrategy[list[int]]:
    """A prompt as token ids of the vocabulary."""
    return st.lists(st.integers(0, limits.vocab_size - 1), min_size=min_size,
                    max_size=limits.max_prompt_tokens if max_size is None else max_size)


def text_prompts(limits: Limits) -> st.SearchStrategy[str]:
    """A text prompt: a phrase or any printable text, never empty."""
    printable = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1,
                        max_size=limits.max_prompt_chars)
    return st.one_of(st.sampled_from([p for p in _PHRASES if len(p) <= limits.max_prompt_chars] or ["Hi"]), printable)


def prompts(limits: Limits) -> st.SearchStrategy[str | list[int]]:
    """A text prompt (with a tokenizer) or token ids."""
    ids: st.SearchStrategy[str | list[int]] = token_ids(limits)
    return st.one_of(text_prompts(limits), ids) if limits.has_tokenizer else ids


# ---- sampling parameters ---------------------------------------------------------------

_STOP_WORDS = [".", ",", "\n", " the", "e", "1", "?", ":", "and", "!"]


def stop_strings(max_count: int = 3) -> st.SearchStrategy[str | list[str]]:
    """`stop`: one string or a list; common fragments a model's text holds, or short text."""
    one = st.one_of(st.sampled_from(_STOP_WORDS), st.text(string.ascii_lowercase + " ,.", min_size=1, max_size=3))
    return st.one_of(one, st.lists(one, min_size=1, max_size=max_count))


def _as(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {name: value}


def _unit(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_subnormal=False)


def _ids(limits: Limits, max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, limits.vocab_size - 1), max_size=max_size)


def _trie(limits: Limits) -> st.SearchStrategy[dict[str, Any]]:
    # Unnamed: a named trie stays in the scheduler for later requests.
    seq = st.lists(st.integers(0, limits.vocab_size - 1), min_size=1, max_size=3)
    return st.lists(seq, min_size=1, max_size=3).map(_as("sequences"))


def _optional(draw: Draw, out: dict[str, Any], name: str, values: st.SearchStrategy[Any]) -> None:
    if draw(st.booleans()):
        out[name] = draw(values)


def _grammar() -> st.SearchStrategy[dict[str, str]]:
    return st.one_of(json_schemas().map(lambda s: {"json_schema": json.dumps(s)}),
                     regexes().map(_as("regex")))


@st.composite
def plain_sampling_params(draw: Draw, limits: Limits, prompt_tokens: int | None = None) -> dict[str, Any]:
    """Sampling parameters without beam search: any subset of the fields, each within
    its documented range. A request with a grammar or a trie constraint asks no
    min_new_tokens (its mask and the ban of EOS would contend)."""
    cap = limits.new_token_cap(prompt_tokens if prompt_tokens is not None else limits.text_prompt_tokens)
    m = draw(st.integers(0, cap))
    out: dict[str, Any] = {"max_new_tokens": m}
    _optional(draw, out, "temperature", st.one_of(st.just(0.0), _unit(0.0, 2.0)))
    _optional(draw, out, "top_p", _unit(0.05, 1.0))
    _optional(draw, out, "top_k", st.one_of(st.just(-1), st.integers(1, 64)))
    _optional(draw, out, "min_p", _unit(0.0, 1.0))
    for name in ("frequency_penalty", "presence_penalty"):
        _optional(draw, out, name, _unit(-2.0, 2.0))
    _optional(draw, out, "repetition_penalty", _unit(0.1, 2.0))
    if limits.has_tokenizer:
        _optional(draw, out, "stop", stop_strings())
    _optional(draw, out, "stop_token_ids", _ids(limits, 3))
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        _optional(draw, out, name, st.booleans())
    _optional(draw, out, "n", st.integers(1, min(limits.max_n, MAX_N)))
    _optional(draw, out, "seed", st.integers(0, 2**31 - 1))
    _optional(draw, out, "logit_bias", st.dictionaries(st.integers(0, limits.vocab_size - 1), _unit(-5.0, 5.0),
                                                       max_size=3))
    _optional(draw, out, "custom_params", st.dictionaries(st.sampled_from(["a", "b", "k"]), st.integers(0, 9),
                                                          max_size=2))
    constrained = draw(st.integers(0, 7))  # mostly none: they shrink to 0
    if constrained == 6:
        out["constraint"] = draw(_trie(limits))
    elif constrained == 7 and limits.grammars:
        out.update(draw(_grammar()))
    else:
        _optional(draw, out, "min_new_tokens", st.integers(0, m))
    return out


@st.composite
def beam_sampling_params(draw: Draw, limits: Limits, prompt_tokens: int | None = None) -> dict[str, Any]:
    """Sampling parameters of a beam search, in the combinations it takes (greedy, n = 1,
    no stop strings, penalties or sampling filters)."""
    width = draw(st.integers(1, max(1, min(limits.max_beam_width, limits.max_running_requests, MAX_BEAM_WIDTH))))
    prompt = prompt_tokens if prompt_tokens is not None else limits.text_prompt_tokens
    out: dict[str, Any] = {"beam_width": width, "max_new_tokens": draw(st.integers(1, max(1, limits.new_token_cap(
        prompt, width))))}
    _optional(draw, out, "num_return_beams", st.integers(0, width))
    _optional(draw, out, "length_penalty", _unit(-2.0, 2.0))
    _optional(draw, out, "early_stopping", st.sampled_from([True, False, "never"]))
    _optional(draw, out, "temperature", st.sampled_from([0.0, 1.0]))
    _optional(draw, out, "top_k", st.sampled_from([-1, 1]))
    _optional(draw, out, "stop_token_ids", _ids(limits, 2))
    for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        _optional(draw, out, name, st.booleans())
    _optional(draw, out, "seed", st.integers(0, 2**31 - 1))
    _optional(draw, out, "constraint", _trie(limits))
    return out


@st.composite
def sampling_params(draw: Draw, limits: Limits, prompt_tokens: int | None = None,
                    beams: bool = True) -> dict[str, Any]:
    """Valid sampling parameters for a prompt of `prompt_tokens` tokens (None: any prompt
    the limits allow); one in six a beam search when `beams`."""
    beam = beams and draw(st.integers(0, 5)) == 5  # shrinks to plain sampling
    params: dict[str, Any] = draw(beam_sampling_params(limits, prompt_tokens) if beam
                                  else plain_sampling_params(limits, prompt_tokens))
    return params


# ---- whole requests -----------------------------------------------------------------------

@st.composite
def request_options(draw: Draw, limits: Limits, prompt_tokens: int | None = None,
                    beam: bool = False) -> dict[str, Any]:
    """Request-level options (logprobs, detokenize). `prompt_tokens` bounds
    logprob_start_len (None: a text prompt, of at least one token); a beam request
    takes no return_logprob."""
    out: dict[str, Any] = {}
    _optional(draw, out, "detokenize", st.booleans())
    if beam or not draw(st.booleans()):
        return out
    out["return_logprob"] = True
    last = prompt_tokens - 1 if prompt_tokens is not None else 0
    _optional(draw, out, "logprob_start_len", st.integers(-1, last))
    _optional(draw, out, "top_logprobs_num", st.integers(0, min(5, limits.max_top_logprobs_num)))
    _optional(draw, out, "token_ids_logprob", st.lists(st.integers(0, limits.vocab_size - 1), min_size=1,
                                                       max_size=3, unique=True))
    _optional(draw, out, "return_text_in_logprobs", st.booleans())
    return out


_RIDS = st.uuids().map(lambda u: u.hex)  # no "-": a sample's rid is "<rid>-<i>"


@st.composite
def generate_requests(draw: Draw, limits: Limits, stream: bool | None = None, batch: bool = True,
                      beams: bool = True, text: bool | None = None) -> GenerateRequest:
    """A whole generate call: one prompt or (with `batch`) a batch of up to max_batch,
    text (with a tokenizer; `text` forces either kind) or ids, per-prompt sampling
    parameters, shared request options, maybe rids. `stream` None draws it; a request
    with a beam search never streams."""
    use_text = limits.has_tokenizer and (draw(st.booleans()) if text is None else text)
    size = draw(st.integers(1, limits.max_batch)) if batch and draw(st.booleans()) else 0
    count = max(size, 1)
    if use_text:
        texts = draw(st.lists(text_prompts(limits), min_size=count, max_size=count))
        lengths: list[int | None] = [None] * count
    else:
        id_lists = draw(st.lists(token_ids(limits), min_size=count, max_size=count))
        lengths = [len(ids) for ids in id_lists]
    params = [draw(sampling_params(limits, n, beams=beams and stream is not True)) for n in lengths]
    has_beam = any(p.get("beam_width") for p in params)
    shortest = min((n for n in lengths if n is not None), default=None)
    options = draw(request_options(limits, shortest, beam=has_beam))
    streamed = False if has_beam else draw(st.booleans()) if stream is None else stream
    rids = draw(st.none() | st.lists(_RIDS, min_size=count, max_size=count, unique=True))
    if size == 0:
        return GenerateRequest(prompt=texts[0] if use_text else None, input_ids=None if use_text else id_lists[0],
                               sampling_params=params[0], options=options, rid=rids[0] if rids else None,
                               stream=streamed)
    return GenerateRequest(prompt=texts if use_text else None, input_ids=None if use_text else id_lists,
                           sampling_params=params, options=options, rid=rids, stream=streamed)


# ---- invalid requests -------------------------------------------------------------------------

Breaks = list[tuple[str, st.SearchStrategy[dict[str, Any]]]]  # (the field named, what breaks it)


@dataclass(frozen=True)
class InvalidRequest:
    """A request the engine refuses with a ValueError whose message names `field`."""

    request: GenerateRequest
    field: str


def _breaks(limits: Limits, prompt: int) -> Breaks:
    """(field, changes to valid sampling parameters that break it) for every field a
    ValueError of SamplingParams or of the request checks names."""
    v = limits.vocab_size
    below, above = st.floats(max_value=-1e-3), st.floats(min_value=1.001)
    alone: dict[str, st.SearchStrategy[Any]] = {  # a value that breaks the field by itself
        "max_new_tokens": st.one_of(st.integers(max_value=-1), st.integers(2**63, 2**64), st.just("ten"),
                                    st.integers(limits.context_length - prompt + 1, limits.context_length + 64)),
        "temperature": st.one_of(below, st.sampled_from([float("nan"), float("inf")])),
        "top_p": st.one_of(st.just(0.0), below, above),
        "top_k": st.one_of(st.just(0), st.integers(max_value=-2)),
        "min_p": st.one_of(below, above),
        "frequency_penalty": st.one_of(st.floats(max_value=-2.001), st.floats(min_value=2.001)),
        "presence_penalty": st.one_of(st.floats(max_value=-2.001), st.floats(min_value=2.001)),
        "repetition_penalty": st.one_of(st.floats(max_value=0.0), st.floats(min_value=2.001)),
        "n": st.one_of(st.integers(max_value=0), st.integers(MAX_N + 1, 10**6)),
        "seed": st.integers(max_value=-1),
        "stop": st.sampled_from(["", ["ok", ""], ["s"] * (MAX_STOP_STRS + 1), "x" * (MAX_STOP_STR_CHARS + 1)]),
        "stop_token_ids": st.one_of(st.integers(max_value=-1), st.integers(v, v + 1000)).map(lambda t: [1, t])
        | st.just([1] * (MAX_STOP_TOKEN_IDS + 1)),
        "logit_bias": st.integers(v, v + 1000).map(lambda t: {t: 1.0})
        | st.sampled_from([float("inf"), float("nan")]).map(lambda b: {1: b}),
        "beam_width": st.one_of(st.integers(max_value=-1), st.integers(MAX_BEAM_WIDTH + 1, 10**4)),
        "length_penalty": st.one_of(st.floats(min_value=10.001), st.floats(max_value=-10.001), st.just(float("nan"))),
        "early_stopping": st.sampled_from(["maybe", "always", ""]),
        "json_schema": st.just(""),
        "constraint": st.just({}),
    }
    beam = {"beam_width": 2, "max_new_tokens": 2}
    with_beams: Breaks = [  # what a beam search refuses
        ("num_return_beams", st.integers(3, 20).map(lambda k: {**beam, "num_return_beams": k})),
        ("temperature", _unit(0.05, 0.95).map(lambda t: {**beam, "temperature": t})),
        ("n", st.integers(2, 4).map(lambda n: {**beam, "n": n})),
        ("stop", st.just({**beam, "stop": ["."]})),
        ("top_p", _unit(0.1, 0.9).map(lambda x: {**beam, "top_p": x})),
        ("frequency_penalty", _unit(0.1, 1.0).map(lambda x: {**beam, "frequency_penalty": x})),
        ("max_new_tokens", st.just({**beam, "max_new_tokens": 0})),
    ]
    together: Breaks = [
        ("min_new_tokens", st.integers(2, 50).map(lambda x: {"max_new_tokens": 1, "min_new_tokens": x})),
        ("regex", st.just({"json_schema": "{}", "regex": "[0-9]+"})),  # named: the last of two grammars
        ("constraint", st.just({"regex": "[0-9]+", "constraint": {"sequences": [[1]]}})),
        ("constraint.sequences", st.integers(v, v + 1000).map(lambda t: {"constraint": {"sequences": [[1, t]]}})),
        ("max_tokens", st.just({"max_tokens": 8})),  # an unknown field: OpenAI's name, not SGLang's
    ]
    return [(name, values.map(_as(name))) for name, values in alone.items()] + with_beams + together


def _option_breaks(limits: Limits, prompt: int) -> Breaks:
    """(field, request options that break it)."""
    v = limits.vocab_size
    return [
        ("logprob_start_len", st.one_of(st.integers(max_value=-2), st.integers(prompt, prompt + 50)).map(
            lambda s: {"return_logprob": True, "logprob_start_len": s})),
        ("top_logprobs_num", st.one_of(st.integers(max_value=-1), st.integers(limits.max_top_logprobs_num + 1,
                                                                             1000)).map(
            lambda k: {"return_logprob": True, "top_logprobs_num": k})),
        ("token_ids_logprob", st.one_of(st.integers(v, v + 1000).map(lambda t: [t]),
                                        st.just([1] * (MAX_TOKEN_IDS_LOGPROB + 1))).map(
            lambda ids: {"return_logprob": True, "token_ids_logprob": ids})),
        ("detokenize", st.sampled_from([1, "yes", None]).map(_as("detokenize"))),
        ("return_logprob", st.sampled_from([1, "yes"]).map(_as("return_logprob"))),
    ]


@st.composite
def invalid_sampling_params(draw: Draw, limits: Limits, prompt_tokens: int = 4) -> tuple[dict[str, Any], str]:
    """(sampling parameters the engine refuses for a prompt of `prompt_tokens` ids, the
    field its ValueError names): valid ones with one field broken."""
    field, changes = draw(st.sampled_from(_breaks(limits, prompt_tokens)))
    base = draw(plain_sampling_params(limits.replace(has_tokenizer=False, grammars=False), prompt_tokens))
    for key in ("min_new_tokens", "constraint", "n", "stop", "temperature", "top_p", "top_k", "min_p",
                "frequency_penalty", "presence_penalty", "repetition_penalty"):
        base.pop(key, None)  # what a break combines with (beams refuse these; a trie excludes a grammar)
    return {**base, **draw(changes)}, field


@st.composite
def invalid_requests(draw: Draw, limits: Limits) -> InvalidRequest:
    """A request (one prompt of ids) the engine refuses, with the field its ValueError
    names: a broken sampling parameter, request option or prompt, a beam search asking
    for logprobs or a stream, a rid of the wrong type, or (without a tokenizer) stop
    strings."""
    ids = draw(token_ids(limits))
    kind = draw(st.sampled_from(["params", "params", "params", "options", "prompt", "other"]))
    if kind == "params":
        params, field = draw(invalid_sampling_params(limits, len(ids)))
        return InvalidRequest(GenerateRequest(input_ids=ids, sampling_params=params), field)
    params = draw(plain_sampling_params(limits.replace(has_tokenizer=False, grammars=False), len(ids)))
    if kind == "options":
        field, options = draw(st.sampled_from(_option_breaks(limits, len(ids))))
        return InvalidRequest(GenerateRequest(input_ids=ids, sampling_params=params, options=draw(options)), field)
    if kind == "prompt":
        bad = draw(st.one_of(st.just([]), st.integers(limits.vocab_size, limits.vocab_size + 1000).map(
            lambda t: [*ids, t]), st.integers(max_value=-1).map(lambda t: [t, *ids])))
        return InvalidRequest(GenerateRequest(input_ids=bad, sampling_params=params), "input_ids")
    beam = {"beam_width": 2, "max_new_tokens": 2}
    others = [InvalidRequest(GenerateRequest(input_ids=ids, sampling_params=beam,
                                             options={"return_logprob": True}), "return_logprob"),
              InvalidRequest(GenerateRequest(input_ids=ids, sampling_params=beam, stream=True), "stream"),
              InvalidRequest(GenerateRequest(input_ids=ids, sampling_params=params, rid=draw(
                  st.sampled_from([7, ["a"]]))), "rid")]
    if not limits.has_tokenizer:
        others.append(InvalidRequest(GenerateRequest(input_ids=ids, sampling_params={"stop": "."}), "stop"))
    return draw(st.sampled_from(others))


# ---- structured output: schemas, instances, regular expressions ---------------------------------

_PROPERTY_NAMES = ["id", "name", "city", "count", "price", "ok", "tags", "kind", "note"]


def _leaf_schemas() -> st.SearchStrategy[dict[str, Any]]:
    bounded_int = st.tuples(st.integers(-100, 100), st.integers(0, 1000)).map(
        lambda lo_span: {"type": "integer", "minimum": lo_span[0], "maximum": lo_span[0] + lo_span[1]})
    return st.one_of(
        st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
                         {"type": "string"}, {"type": "string", "pattern": "^[a-z]{1,6}$"}]),
        bounded_int,
        st.integers(1, 10).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.sampled_from(["red", "green", "blue", "a b", "x"]), min_size=1, max_size=4,
                 unique=True).map(_as("enum")),
    )


def json_schemas(max_depth: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    """Small JSON schemas of an object (as a tool's parameters are) that xgrammar compiles
    and jsonschema reads alike: typed properties (bounded integers, strings with a
    length or a pattern, enums, booleans, nulls), arrays, nested objects, required
    keys, no additional properties."""
    def objects(depth: int) -> st.SearchStrategy[dict[str, Any]]:
        child = _leaf_schemas() if depth >= max_depth else st.one_of(_leaf_schemas(), _leaf_schemas(),
                                                                      st.deferred(lambda: nested(depth + 1)))
        props = st.dictionaries(st.sampled_from(_PROPERTY_NAMES), child, min_size=1, max_size=3)
        return props.flatmap(lambda ps: st.lists(st.sampled_from(sorted(ps)), unique=True).map(
            lambda req: {"type": "object", "properties": ps, "required": sorted(req), "additionalProperties": False}))

    def nested(depth: int) -> st.SearchStrategy[dict[str, Any]]:
        arrays = st.tuples(_leaf_schemas(), st.integers(0, 2), st.integers(0, 3)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
        return st.one_of(objects(depth), arrays)

    return objects(1)


_PLAIN_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "title", "description"})


def json_instances(schema: Mapping[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under `schema`: hypothesis-jsonschema's `from_schema`. A closed object
    (typed properties, required keys, no additional ones, as `json_schemas` draws) is
    composed here from its strategies for the properties: its own object strategy
    steps a Hypothesis internal (`many.more`) that Hypothesis 6.156 removed."""
    if schema.get("type") == "object" and schema.get("additionalProperties") is False \
            and set(schema) <= _PLAIN_OBJECT_KEYS:
        props, required = schema.get("properties", {}), set(schema.get("required", ()))
        return st.fixed_dictionaries({k: json_instances(v) for k, v in props.items() if k in required},
                                     optional={k: json_instances(v) for k, v in props.items() if k not in required})
    return from_schema(dict(schema))


_REGEX_ATOMS = [r"[0-9]{1,3}", r"(yes|no)", r"[a-z]{2,5}", r"[A-Z][a-z]{0,4}", r"-", r" ", r"(ab)+", r"x?",
                r"[a-f0-9]{4}", r"(cat|dog)s?", r"@", r"[0-9]+\.[0-9]{2}"]


def regexes(max_atoms: int = 4) -> st.SearchStrategy[str]:
    """Regular expressions that Python's re and xgrammar read alike (literals, classes,
    alternations, bounded and unbounded repeats)."""
    return st.lists(st.sampled_from(_REGEX_ATOMS), min_size=1, max_size=max_atoms).map("".join)


# ---- chat -------------------------------------------------------------------------------------

_TOOL_NAME = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)
_CONTENT = st.one_of(st.sampled_from(_PHRASES), st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Co")),
                                                        min_size=1, max_size=40))


def tools(max_tools: int = 3) -> st.SearchStrategy[list[dict[str, Any]]]:
    """OpenAI function tools: unique names, a description, parameters as a JSON schema."""
    def tool(name: str) -> st.SearchStrategy[dict[str, Any]]:
        return st.tuples(_CONTENT, json_schemas(max_depth=1)).map(lambda dp: {
            "type": "function", "function": {"name": name, "description": dp[0], "parameters": dp[1]}})

    names = st.lists(_TOOL_NAME, min_size=1, max_size=max_tools, unique=True)
    return names.flatmap(lambda ns: st.tuples(*[tool(n) for n in ns]).map(list))


@st.composite
def chat_messages(draw: Draw, max_turns: int = 3,
                  tool_list: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """An OpenAI chat conversation ending with the user's (or a tool's) turn: maybe a
    system message, then user and assistant turns; with `tool_list`, assistant turns
    may call those tools (arguments drawn from their parameters) and tool messages
    answer each call."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_CONTENT)})
    turns = draw(st.integers(1, max_turns))
    for turn in range(turns):
        messages.append({"role": "user", "content": draw(_CONTENT)})
        if turn == turns - 1:
            break
        if tool_list and draw(st.booleans()):
            fn = draw(st.sampled_from(tool_list))["function"]
            call_id = f"call_{turn}"
            args = draw(json_instances(fn["parameters"]))
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": json.dumps(args)}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": draw(_CONTENT)})
            if draw(st.booleans()):
                break  # the conversation ends on the tool's answer
        else:
            messages.append({"role": "assistant", "content": draw(_CONTENT)})
    return messages
