"""The engine's contract as a checker: given a request and what an engine returned for
it (a result, or the chunks of a stream), raise a `ContractViolation` (an
AssertionError) whose message starts with the broken rule's id in brackets, e.g.
`[stop-trim] prompt 0: ...`. `RULES` lists every id with what it requires. Also a
leak check on an engine's server info (`assert_no_leaks`, `assert_engine_clean`).

What an engine returns is read, never changed. Rules that need a fact about the
engine (its EOS ids, whether it has a tokenizer, how it decodes) take it from
`EngineFacts`, and are skipped where the fact is unknown. It imports no torch;
jsonschema is imported only when a JSON output is checked."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeGuard

import regex

from sgl.core.stop_rule import stop_cut
from sgl.runtime.result_format import LOGPROB_KEYS
from sgl.testing._request import GenerateRequest, RequestItem

__all__ = ["RULES", "Contract", "ContractViolation", "Decoder", "EngineFacts", "GenerateRequest", "RequestItem",
           "assert_engine_clean", "assert_no_leaks", "check_result", "check_stream", "tokenizer_decoder"]

RULES: dict[str, str] = {
    "shape": "a result is a dict of text (str), output_ids (a list of ints) and meta_info (a dict)",
    "meta": "meta_info holds id, prompt_tokens, completion_tokens, cached_tokens, finish_reason, weight_version "
            "and (once finished) e2e_latency, of their types, and no key the engine does not fill",
    "meta-id": "meta_info's id is the rid the request gave (sample i of n: rid-i)",
    "prompt-tokens": "prompt_tokens is the prompt's length in ids; cached_tokens lies in [0, prompt_tokens]",
    "output-ids": "output_ids holds completion_tokens ids",
    "length": "completion_tokens lies in [min_new_tokens, max_new_tokens], or in [0, max_new_tokens] if aborted",
    "finish-reason": "a finished result's finish_reason is {type: stop, matched: int or str}, "
                     "{type: length, length: int} or {type: abort, message: str}",
    "finish-length": "a length finish's length equals completion_tokens and max_new_tokens",
    "finish-stop": "a stop comes past min_new_tokens (grammar requests aside); a matched string is one the "
                   "request gave; a matched id ends output_ids and is a requested stop id or, without "
                   "ignore_eos or with a grammar, an EOS id",
    "stop-trim": "without no_stop_trim (and with min_new_tokens 0) the text holds none of the request's stop "
                 "strings; with no_stop_trim, a matched stop string stays in the text",
    "text": "the text is the decode of output_ids, less a matched stop id and cut at a matched stop string "
            "unless no_stop_trim (checked when EngineFacts has a decoder)",
    "detokenize": "detokenize=False, or an engine without a tokenizer, gives empty text",
    "n": "a prompt with n > 1 gives a list of exactly n results, in sample order",
    "batch": "a batch gives one entry per prompt, in order",
    "beams": "a beam request gives a list of 1 to num_return_beams (0: beam_width) beams with beam_index "
             "0, 1, ... in order, scores non-increasing, score = cumulative_logprob / completion_tokens ** "
             "length_penalty",
    "logprob-keys": "with return_logprob, meta_info has output_token_logprobs and input_token_logprobs, the "
                    "top ones iff top_logprobs_num > 0, the token-id ones iff token_ids_logprob; without it, none",
    "logprob-shape": "logprobs are (logprob, token_id, text) triples: one per output token with the output's "
                     "ids, one per prompt position from logprob_start_len (the first None at position 0) with "
                     "the prompt's ids, top lists of top_logprobs_num non-increasing entries, token-id lists in "
                     "the order asked; text is None unless return_text_in_logprobs",
    "grammar": "a json_schema output that ended at EOS parses and validates against the schema; a regex "
               "output that ended at EOS matches it in full",
    "chunk-shape": "a chunk is a result-shaped delta; it has an index in [0, samples) iff the stream has "
                   "several samples (n > 1 or a batch); e2e_latency only on its final chunk",
    "chunk-final": "each sample's stream ends with exactly one chunk with a finish_reason, its last",
    "chunk-repeat": "no chunk comes twice",
    "chunk-count": "a chunk's completion_tokens counts its sample's output ids so far; its id does not change",
    "chunk-logprobs": "a chunk carries one output logprob entry per new output id",
    "stream-join": "a deterministic request's joined chunks equal its non-streamed result: text, output_ids, "
                   "finish_reason, token counts, and logprobs (values within 1e-3)",
    "leak-requests": "an idle engine runs, queues and compiles nothing",
    "leak-open": "no request is left open in the engine's front end",
    "leak-kv": "every KV slot is free or evictable (after a flush: free)",
    "leak-protected": "no KV slot is locked by a request",
    "leak-invariants": "the scheduler counted no broken invariant",
}

_BEAM_KEYS = ("cumulative_logprob", "score", "beam_index")
_BASE_META = ("id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "weight_version")
_LOGPROB_TOL = 1e-4  # a log probability is <= 0, up to float rounding

# (ids, skip_special_tokens, spaces_between_special_tokens) -> text, as the detokenizer decodes
Decoder = Callable[[list[int], bool, bool], str]


class ContractViolation(AssertionError):
    """A broken rule of the engine's contract; `rule` is its id in `RULES`."""

    def __init__(self, rule: str, detail: str) -> None:
        assert rule in RULES, rule
        super().__init__(f"[{rule}] {detail}")
        self.rule = rule


@dataclass(frozen=True)
class EngineFacts:
    """What some rules need to know of the engine; None: unknown (those rules are skipped)."""

    eos_token_ids: frozenset[int] | None = None
    has_tokenizer: bool | None = None
    decode: Decoder | None = None  # the engine's tokenizer's decode, for the exact-text rule

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any], *, has_tokenizer: bool | None = None,
                         decode: Decoder | None = None) -> EngineFacts:
        eos = info.get("eos_token_ids")
        return cls(None if eos is None else frozenset(eos), has_tokenizer, decode)


def tokenizer_decoder(tokenizer: Any) -> Decoder:
    """A `Decoder` from a Hugging Face tokenizer (e.g. an engine's `tokenizer`)."""
    def decode(ids: list[int], skip: bool, spaces: bool) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces))
    return decode


def fail(rule: str, where: str, detail: str) -> NoReturn:
    raise ContractViolation(rule, f"{where}: {detail}")


def require(ok: bool, rule: str, where: str, detail: str) -> None:
    if not ok:
        fail(rule, where, detail)


def short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Contract:
    """The rules, for one engine's facts."""

    def __init__(self, facts: EngineFacts | None = None) -> None:
        self.facts = facts or EngineFacts()

    def check_result(self, request: GenerateRequest, result: Any) -> None:
        """What `generate` returned for `request` (not streamed) keeps every rule."""
        items = request.items()
        if request.is_batch:
            require(isinstance(result, list) and len(result) == len(items), "batch", "result",
                    f"{len(items)} entries expected, got {short(result)}")
            for item, entry in zip(items, result):
                self._check_item(item, entry, f"prompt {item.position}")
        else:
            self._check_item(items[0], result, "result")

    def _check_item(self, item: RequestItem, entry: Any, where: str) -> None:
        if item.is_beam:
            BeamRules(item, self.facts, where).check(entry)
        elif item.samples > 1:
            require(isinstance(entry, list) and len(entry) == item.samples, "n", where,
                    f"n={item.samples} results expected, got {short(entry)}")
            for k, out in enumerate(entry):
                SampleRules(item, self.facts, f"{where} sample {k}", k).check(out)
        else:
            SampleRules(item, self.facts, where, 0).check(entry)

    def check_stream(self, request: GenerateRequest, chunks: Sequence[Any], result: Any = None) -> None:
        """The chunks `stream` gave for `request` keep the chunk rules, joined they keep
        every result rule, and, when `result` (the same request's non-streamed result)
        is given and the request is deterministic, they join to it."""
        from sgl.testing._stream_contract import StreamRules

        StreamRules(request, self).check(chunks, result)


def check_result(request: GenerateRequest, result: Any, facts: EngineFacts | None = None) -> None:
    """Raise a ContractViolation naming the broken rule if `result` breaks the contract."""
    Contract(facts).check_result(request, result)


def check_stream(request: GenerateRequest, chunks: Sequence[Any], result: Any = None,
                 facts: EngineFacts | None = None) -> None:
    """As `check_result`, for a stream's chunks (and the non-streamed `result`, if given)."""
    Contract(facts).check_stream(request, chunks, result)


class SampleRules:
    """The rules for one result dict (a sample, or a beam) of one prompt."""

    def __init__(self, item: RequestItem, facts: EngineFacts, where: str, sample: int) -> None:
        self.item, self.facts, self.where, self.sample = item, facts, where, sample
        self.p = item.params

    def check(self, out: Any) -> None:
        self.shape(out)
        meta = out["meta_info"]
        self.meta(meta, final=True)
        n = meta["completion_tokens"]
        require(len(out["output_ids"]) == n, "output-ids", self.where,
                f"{len(out['output_ids'])} output_ids for completion_tokens={n}")
        fin = meta["finish_reason"]
        self.finish_reason(fin)
        self.length(fin, n)
        if fin["type"] == "stop":
            self.stop(fin["matched"], n, out["output_ids"])
        self.detokenize(out["text"])
        self.stop_trim(out["text"], fin)
        self.text(out["text"], out["output_ids"], fin)
        self.logprobs(meta, out["output_ids"])
        self.grammar(out["text"], fin)

    def shape(self, out: Any, extra: tuple[str, ...] = ()) -> None:
        require(isinstance(out, dict) and set(out) == {"text", "output_ids", "meta_info", *extra}, "shape",
                self.where, f"a dict of text, output_ids, meta_info{''.join(', ' + k for k in extra)} "
                f"expected, got {short(out)}")
        require(isinstance(out["text"], str), "shape", self.where, f"text is {short(out['text'])}")
        ids = out["output_ids"]
        require(isinstance(ids, list) and all(is_int(t) and t >= 0 for t in ids), "shape", self.where,
                f"output_ids is {short(ids)}")
        require(isinstance(out["meta_info"], dict), "shape", self.where, f"meta_info is {short(out['meta_info'])}")

    def meta(self, meta: dict[str, Any], final: bool) -> None:
        missing = [k for k in _BASE_META if k not in meta]
        require(not missing, "meta", self.where, f"meta_info lacks {missing}")
        extra = ("e2e_latency",) if final else ()
        known = {*_BASE_META, *extra, *LOGPROB_KEYS, *(_BEAM_KEYS if self.item.is_beam else ())}
        unknown = sorted(set(meta) - known)
        require(not unknown, "meta", self.where, f"meta_info has keys the engine does not fill: {unknown}")
        if final:
            e2e = meta.get("e2e_latency")
            require(is_number(e2e) and e2e >= 0, "meta", self.where, f"e2e_latency is {short(e2e)}")
        require(isinstance(meta["id"], str) and meta["id"] != "", "meta", self.where, f"id is {short(meta['id'])}")
        require(isinstance(meta["weight_version"], str), "meta", self.where,
                f"weight_version is {short(meta['weight_version'])}")
        for k in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            require(is_int(meta[k]) and meta[k] >= 0, "meta", self.where, f"{k} is {short(meta[k])}")
        want = self.item.sample_id(self.sample)
        require(want is None or meta["id"] == want, "meta-id", self.where, f"id {meta['id']!r}, rid gave {want!r}")
        ids = self.item.input_ids
        require(ids is None or meta["prompt_tokens"] == len(ids), "prompt-tokens", self.where,
                f"prompt_tokens={meta['prompt_tokens']} for a prompt of {len(ids or ())} ids")
        require(meta["prompt_tokens"] >= 1 and meta["cached_tokens"] <= meta["prompt_tokens"], "prompt-tokens",
                self.where, f"prompt_tokens={meta['prompt_tokens']}, cached_tokens={meta['cached_tokens']}")

    def finish_reason(self, fin: Any) -> None:
        require(isinstance(fin, dict), "finish-reason", self.where, f"a finished result's finish_reason is {fin!r}")
        kind = fin.get("type")
        if kind == "stop":
            ok = set(fin) == {"type", "matched"} and (is_int(fin["matched"]) or isinstance(fin["matched"], str))
        elif kind == "length":
            ok = set(fin) == {"type", "length"} and is_int(fin["length"])
        elif kind == "abort":
            ok = set(fin) == {"type", "message"} and isinstance(fin["message"], str) and fin["message"] != ""
        else:
            ok = False
        require(ok, "finish-reason", self.where, f"finish_reason {short(fin)}")

    def length(self, fin: dict[str, Any], n: int) -> None:
        p, kind = self.p, fin["type"]
        low = 0 if kind == "abort" else p.min_new_tokens
        require(low <= n <= p.max_new_tokens, "length", self.where,
                f"{n} tokens ({kind}) outside [{low}, max_new_tokens={p.max_new_tokens}]")
        if kind == "length":
            require(fin["length"] == n == p.max_new_tokens, "finish-length", self.where,
                    f"length={fin['length']} with completion_tokens={n}, max_new_tokens={p.max_new_tokens}")

    def stop(self, matched: int | str, n: int, ids: list[int]) -> None:
        """A stop finish: what it matched, and when."""
        p = self.p
        grammar = p.grammar is not None  # a complete grammar ends at EOS whatever else holds
        require(grammar or n > p.min_new_tokens, "finish-stop", self.where,
                f"stopped after {n} tokens, within min_new_tokens={p.min_new_tokens}")
        if isinstance(matched, str):
            require(matched in p.stop_strs or any(regex.fullmatch(r, matched) for r in p.stop_regexes),
                    "finish-stop", self.where,
                    f"matched {matched!r}, not one of the stop strings {p.stop_strs} nor regexes {p.stop_regexes}")
            return
        require(bool(ids) and ids[-1] == matched, "finish-stop", self.where,
                f"matched id {matched} is not the last output id (ids end {ids[-3:]})")
        if matched in p.stop_token_ids:
            return
        eos = self.facts.eos_token_ids
        require(grammar or not p.ignore_eos, "finish-stop", self.where,
                f"matched id {matched} is no requested stop id, and ignore_eos is set")
        require(eos is None or matched in eos, "finish-stop", self.where,
                f"matched id {matched} is neither a requested stop id {p.stop_token_ids} nor EOS {sorted(eos or ())}")

    def has_text(self) -> bool | None:
        """Whether the output was decoded (None: unknown, the engine's tokenizer unknown)."""
        if not self.item.options.detokenize or self.facts.has_tokenizer is False:
            return False
        return self.facts.has_tokenizer

    def detokenize(self, text: str) -> None:
        if self.has_text() is False:
            why = "detokenize=False" if not self.item.options.detokenize else "an engine without a tokenizer"
            require(text == "", "detokenize", self.where, f"text {short(text)} with {why}")

    def stop_trim(self, text: str, fin: dict[str, Any]) -> None:
        stops = self.p.stop_strs
        if not stops or self.has_text() is False:
            return
        matched = fin.get("matched") if fin["type"] == "stop" else None
        if self.p.no_stop_trim:
            require(not isinstance(matched, str) or matched in text, "stop-trim", self.where,
                    f"no_stop_trim, but the matched {matched!r} is not in the text {short(text)}")
        elif self.p.min_new_tokens == 0:
            # Every token's text was matched against the stop strings, so an occurrence would have
            # ended the output there (and been trimmed).
            for s in stops:
                require(s not in text, "stop-trim", self.where, f"text {short(text)} holds stop string {s!r}")

    def text(self, text: str, ids: list[int], fin: dict[str, Any]) -> None:
        decode = self.facts.decode
        if decode is None or not self.has_text():
            return
        p = self.p
        matched = fin.get("matched") if fin["type"] == "stop" and not p.no_stop_trim else None
        kept = ids[:-1] if is_int(matched) and ids and ids[-1] == matched else ids
        full = decode(kept, p.skip_special_tokens, p.spaces_between_special_tokens)
        if isinstance(matched, str) and not self.item.is_beam:
            cut = stop_cut(full, matched, len(decode(kept[:-1], p.skip_special_tokens,
                                                     p.spaces_between_special_tokens)))
            full = full[:cut] if cut >= 0 else full
        rule = "stop-trim" if isinstance(matched, str) else "text"
        require(text == full, rule, self.where, f"text {short(text)}, the decode of its ids gives {short(full)}")

    def logprobs(self, meta: dict[str, Any], ids: list[int]) -> None:
        LogprobRules(self.item, self.where).check(meta, ids, meta["prompt_tokens"])

    def grammar(self, text: str, fin: dict[str, Any]) -> None:
        g = self.p.grammar
        if g is None or g[0] == "ebnf" or not self.completed(fin):
            return
        kind, spec = g
        if kind == "regex":
            require(re.fullmatch(spec, text) is not None, "grammar", self.where,
                    f"text {short(text)} does not match the regex {spec!r}")
            return
        try:
            value = json.loads(text)
        except ValueError as e:
            fail("grammar", self.where, f"text {short(text)} is no JSON: {e}")
        import jsonschema  # type: ignore[import-untyped]

        try:
            jsonschema.validate(value, json.loads(spec))
        except jsonschema.ValidationError as e:
            fail("grammar", self.where, f"{short(value)} breaks the schema: {e.message}")

    def completed(self, fin: dict[str, Any]) -> bool:
        """Whether the grammar's whole output is in the text: it ended at EOS, decoded,
        with EOS's text left out."""
        p = self.p
        return (fin["type"] == "stop" and is_int(fin["matched"]) and fin["matched"] not in p.stop_token_ids
                and bool(self.has_text()) and not (p.no_stop_trim and not p.skip_special_tokens))


class BeamRules:
    """The rules for a beam request's list of beams."""

    def __init__(self, item: RequestItem, facts: EngineFacts, where: str) -> None:
        self.item, self.facts, self.where = item, facts, where

    def check(self, beams: Any) -> None:
        p = self.item.params
        require(isinstance(beams, list) and 1 <= len(beams) <= p.return_beams, "beams", self.where,
                f"a list of 1 to {p.return_beams} beams expected, got {short(beams)}")
        for k, beam in enumerate(beams):
            rules = SampleRules(self.item, self.facts, f"{self.where} beam {k}", 0)
            rules.check(beam)
            meta = beam["meta_info"]
            missing = [key for key in _BEAM_KEYS if key not in meta]
            require(not missing, "beams", rules.where, f"meta_info lacks {missing}")
            require(meta["beam_index"] == k, "beams", rules.where, f"beam_index {meta['beam_index']!r} at place {k}")
            aborted = meta["finish_reason"]["type"] == "abort"
            if aborted and meta["score"] is None:
                require(len(beams) == 1 and meta["cumulative_logprob"] is None, "beams", rules.where,
                        "a beam request that ended without beams gives its final result alone, with no scores")
                continue
            self.score(rules.where, meta, p.length_penalty)
        scores = [b["meta_info"]["score"] for b in beams]
        require(all(a >= b for a, b in zip(scores, scores[1:])), "beams", self.where,
                f"scores {scores} are not best first")

    @staticmethod
    def score(where: str, meta: dict[str, Any], length_penalty: float) -> None:
        cum, score, n = meta["cumulative_logprob"], meta["score"], meta["completion_tokens"]
        require(is_number(cum) and is_number(score) and n >= 1, "beams", where,
                f"cumulative_logprob={cum!r}, score={score!r} after {n} tokens")
        want = cum / n**length_penalty
        require(math.isclose(score, want, rel_tol=1e-6, abs_tol=1e-9), "beams", where,
                f"score {score} is not cumulative_logprob / completion_tokens ** length_penalty = {want}")


class LogprobRules:
    """The logprob lists of one result (or one chunk: `delta`, the prompt's part may be
    split across chunks and is checked on the joined result)."""

    def __init__(self, item: RequestItem, where: str) -> None:
        self.item, self.where = item, where
        self.o = item.options

    def check(self, meta: dict[str, Any], ids: list[int], prompt_tokens: int, delta: bool = False) -> None:
        o = self.o
        want: set[str] = set()
        if o.return_logprob:
            want = {"output_token_logprobs", "input_token_logprobs"}
            if o.top_logprobs_num:
                want |= {"output_top_logprobs", "input_top_logprobs"}
            if o.token_ids_logprob:
                want |= {"output_token_ids_logprobs", "input_token_ids_logprobs"}
        have = {k for k in LOGPROB_KEYS if k in meta}
        require(have == want, "logprob-keys", self.where, f"logprob keys {sorted(have)}, asked for {sorted(want)}")
        if not want:
            return
        self.triples("output_token_logprobs", meta["output_token_logprobs"], ids, first_none=False)
        rows = meta.get("output_top_logprobs"), meta.get("output_token_ids_logprobs")
        self.rows(rows, len(ids), first_none=False)
        if delta:
            return
        start = o.logprob_start_len
        count = prompt_tokens - start if start >= 0 else 0
        prompt = self.item.input_ids[start:] if self.item.input_ids is not None and start >= 0 else None
        inputs = meta["input_token_logprobs"]
        # A request aborted before its prompt's logprobs were all computed reports none of them.
        if not inputs and (meta.get("finish_reason") or {}).get("type") == "abort":
            count = 0
        require(len(inputs) == count, "logprob-shape", self.where,
                f"{len(inputs)} input_token_logprobs for {prompt_tokens} prompt tokens from logprob_start_len={start}")
        self.triples("input_token_logprobs", inputs, prompt, first_none=start == 0)
        self.rows((meta.get("input_top_logprobs"), meta.get("input_token_ids_logprobs")), count, start == 0)

    def triples(self, key: str, entries: Any, ids: list[int] | None, first_none: bool) -> None:
        require(isinstance(entries, list), "logprob-shape", self.where, f"{key} is {short(entries)}")
        got = [self.triple(key, e, at_prompt_start=first_none and i == 0) for i, e in enumerate(entries)]
        require(ids is None or got == list(ids), "logprob-shape", self.where,
                f"{key} has ids {short(got)}, the tokens are {short(ids)}")

    def rows(self, lists: tuple[Any, Any], count: int, first_none: bool) -> None:
        top, chosen = lists
        k = self.o.top_logprobs_num
        for key, value in (("top", top), ("token_ids", chosen)):
            if value is None:
                continue
            require(isinstance(value, list) and len(value) == count, "logprob-shape", self.where,
                    f"{key} logprob rows: {len(value) if isinstance(value, list) else short(value)}, want {count}")
            for i, row in enumerate(value):
                if first_none and i == 0:  # nothing predicts the prompt's first token
                    require(row is None, "logprob-shape", self.where, f"{key} row 0 is {short(row)}, not None")
                    continue
                require(isinstance(row, list), "logprob-shape", self.where, f"{key} row {i} is {short(row)}")
                ids = [self.triple(key, e, at_prompt_start=False) for e in row]
                if key == "top":
                    vals = [e[0] for e in row]
                    require(len(row) == k == len(set(ids)) and all(a >= b for a, b in zip(vals, vals[1:])),
                            "logprob-shape", self.where,
                            f"top row {i} of {len(row)} entries (asked {k}), not distinct best first: {short(row)}")
                else:
                    require(ids == list(self.o.token_ids_logprob or ()), "logprob-shape", self.where,
                            f"token_ids row {i} has ids {ids}, asked {self.o.token_ids_logprob}")

    def triple(self, key: str, entry: Any, at_prompt_start: bool) -> int:
        """The entry's token id, once it is a (logprob, token_id, text) triple (its logprob
        None at the prompt's first position, which nothing predicts)."""
        ok = isinstance(entry, (tuple, list)) and len(entry) == 3
        require(ok, "logprob-shape", self.where, f"{key} entry {short(entry)} is no (logprob, id, text) triple")
        value, token, text = entry
        good_value = value is None if at_prompt_start else is_number(value) and value <= _LOGPROB_TOL
        require(good_value, "logprob-shape", self.where, f"{key} entry {short(entry)}: logprob {value!r}")
        require(is_int(token) and token >= 0, "logprob-shape", self.where, f"{key} entry {short(entry)}: id")
        named = self.o.return_text_in_logprobs
        require(text is None or (named and isinstance(text, str)), "logprob-shape", self.where,
                f"{key} entry {short(entry)}: text {text!r} with return_text_in_logprobs={named}")
        return int(token)


class ServerInfoSource(Protocol):
    """What `assert_engine_clean` needs of an engine: AsyncEngine's control calls."""

    async def get_server_info(self) -> dict[str, Any]: ...

    async def flush_cache(self) -> dict[str, Any]: ...


def assert_no_leaks(info: Mapping[str, Any], *, open_requests: int | None = None, flushed: bool = False) -> None:
    """An idle engine's server info (`get_server_info()`) shows nothing left behind: no
    request running, waiting or compiling, every KV slot free or evictable (free once
    `flushed`), none locked, no broken invariant; `open_requests` (an engine's count of
    requests still open in its front end), when given, is 0."""
    busy = {k: info.get(k) for k in ("running", "waiting", "grammars_compiling")}
    require(busy["running"] == 0 and busy["waiting"] == 0 and not busy["grammars_compiling"], "leak-requests",
            "server info", f"not idle: {busy}")
    require(open_requests in (None, 0), "leak-open", "engine", f"{open_requests} request(s) still open")
    require(info.get("kv_protected") == 0, "leak-protected", "server info",
            f"{info.get('kv_protected')} KV slots locked by requests")
    free, evictable, total = info.get("kv_free"), info.get("kv_evictable"), info.get("max_total_tokens")
    require(is_int(free) and is_int(evictable) and is_int(total) and free + evictable == total, "leak-kv",
            "server info",
            f"kv_free {free} + kv_evictable {evictable} != max_total_tokens {total}")
    require(not flushed or free == total, "leak-kv", "server info",
            f"after a flush, kv_free {free} != max_total_tokens {total}")
    require(info.get("invariant_violations") == 0, "leak-invariants", "server info",
            f"{info.get('invariant_violations')} invariant violations")


async def assert_engine_clean(engine: ServerInfoSource, rounds: int = 100) -> dict[str, Any]:
    """Once the engine's last aborts have landed (each server-info round trip follows them
    on the same channel, up to `rounds` of them), flush its cache and check that nothing
    leaked (`assert_no_leaks`, with its `open_requests` where it has one). Returns the
    server info it checked."""
    for _ in range(rounds):
        info = await engine.get_server_info()
        if not info.get("running") and not info.get("waiting"):
            break
    flushed = (await engine.flush_cache()).get("success", False)
    info = await engine.get_server_info()
    assert_no_leaks(info, open_requests=getattr(engine, "open_requests", None), flushed=bool(flushed))
    return info
