"""SamplingParams: what a request asks of the sampler and the stop logic.

Bottom layer: imports nothing of sgl. Validation errors are ValueErrors that
name the field and the allowed range (SGLang's documented ranges). It does not
know the vocabulary: id ranges are checked where the vocabulary is known."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import regex

# Fields a model's generation_config.json may default when the request leaves them unset.
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# Bounds on what one request may ask for, so that no request can make the engine build
# unbounded state (n samples, stop strings matched every step, a logit-bias table).
MAX_N = 128
MAX_STOP_STRS = 64
MAX_STOP_STR_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 4096
# A bias this large already forces or bans its token; larger ones (up to float64's 1e308)
# would overflow the float32 logits they are added to (inf, then NaN probabilities).
MAX_ABS_LOGIT_BIAS = 1e9
# Temperatures below this are greedy, as in SGLang and vLLM: dividing the logits by less
# overflows float32 (1e-39 turned every probability into NaN).
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_BEAM_WIDTH = 512  # also bounded by the scheduler's request rows (one per beam)
MAX_TRIE_IDS = 4_000_000  # token ids in one inline trie constraint (100k sequences of 40)
MAX_TRIE_NAME_CHARS = 128
MAX_GRAMMAR_CHARS = 200_000  # of one json_schema, regex or ebnf
INT64_MAX = 2**63 - 1  # every integer travels as a 64-bit MessagePack int


class TrieConstraint(msgspec.Struct, tag="trie", tag_field="type", forbid_unknown_fields=True):
    """Decode only continuations that spell one of `sequences` (token ids), then EOS.

    With `name` and `sequences`, the scheduler keeps the built trie under that name
    (replacing one of the same name); with `name` alone, a request uses the trie kept
    under it. A trie's device table is built once per distinct set."""

    sequences: list[list[int]] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        _check(self.sequences is not None or self.name is not None, "constraint", "{}",
               "a trie with sequences, a name, or both")
        if self.name is not None:
            _check(0 < len(self.name) <= MAX_TRIE_NAME_CHARS, "constraint.name", self.name,
                   f"1 to {MAX_TRIE_NAME_CHARS} characters")
            _check_unicode("constraint.name", [self.name])
        if self.sequences is not None:
            _check(len(self.sequences) > 0 and all(self.sequences), "constraint.sequences", "<empty>",
                   "a non-empty list of non-empty id lists")
            total = sum(map(len, self.sequences))
            _check(total <= MAX_TRIE_IDS, "constraint.sequences", f"<{total} ids>", f"at most {MAX_TRIE_IDS} ids")
            _check(all(0 <= t <= INT64_MAX for q in self.sequences for t in q), "constraint.sequences",
                   "<ids>", "non-negative ids")


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 (or under GREEDY_BELOW_TEMPERATURE): greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    # SGLang's regex stops: generation ends where one matches text ending in the newest
    # token; the final text is trimmed at the match (a stream may have sent its start).
    stop_regex: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    logit_bias: dict[int, float] = {}
    custom_params: dict[str, Any] | None = None
    # Beam search (beam_width >= 1): one request, beam_width rows; the result is a list of
    # the best num_return_beams beams (0: beam_width), scored as Hugging Face scores them:
    # cumulative logprob / generated_len ** length_penalty. early_stopping as HF's:
    # False (its heuristic), True (stop at beam_width finished beams) or "never".
    beam_width: int = 0
    num_return_beams: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    constraint: TrieConstraint | None = None
    # Structured output (SGLang's fields; at most one): the output must match a JSON
    # schema (a JSON string; "{}"-like schemas allowed), a regular expression, or an
    # EBNF grammar (GBNF dialect), compiled by xgrammar and enforced token by token.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # A reasoning model's end-of-thinking token: the grammar applies only to the tokens after
    # it (the reasoning is free; SGLang's reasoning-aware grammar). None: from the first token.
    reasoning_end_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n", "seed"):
            v = getattr(self, name)
            _check(v is None or -INT64_MAX <= v <= INT64_MAX, name, v, "a 64-bit integer")
        _check(self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens, ">= 0")
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", self.min_new_tokens,
               f"in [0, max_new_tokens={self.max_new_tokens}]")
        _check(self.temperature >= 0.0 and math.isfinite(self.temperature), "temperature", self.temperature,
               ">= 0 (0 means greedy)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 (disabled) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", self.repetition_penalty, "in (0, 2]")
        _check(1 <= self.n <= MAX_N, "n", self.n, f"in [1, {MAX_N}]")
        _check(self.seed is None or self.seed >= 0, "seed", self.seed, ">= 0")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"<{len(self.stop_token_ids)} ids>",
               f"at most {MAX_STOP_TOKEN_IDS} ids")
        _check(all(0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "non-negative ids")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"<{len(self.logit_bias)} entries>",
               f"at most {MAX_LOGIT_BIAS} entries")
        _check(all(0 <= k <= INT64_MAX and abs(v) <= MAX_ABS_LOGIT_BIAS for k, v in self.logit_bias.items()),
               "logit_bias", self.logit_bias, f"a map of non-negative token ids to floats in [-{MAX_ABS_LOGIT_BIAS:g}, "
               f"{MAX_ABS_LOGIT_BIAS:g}]")
        _check(0 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width", self.beam_width,
               f"in [0, {MAX_BEAM_WIDTH}] (0: no beam search)")
        _check(0 <= self.num_return_beams <= max(self.beam_width, 0), "num_return_beams", self.num_return_beams,
               f"in [0, beam_width={self.beam_width}] (0: all beam_width beams)")
        _check(math.isfinite(self.length_penalty) and -10.0 <= self.length_penalty <= 10.0, "length_penalty",
               self.length_penalty, "a float in [-10, 10]")
        _check(self.early_stopping in (True, False, "never"), "early_stopping", self.early_stopping,
               'true, false or "never"')
        if self.beam_width:
            # Beam search here is HF's greedy beam search: refuse what it does not do.
            _check(self.temperature in (0.0, 1.0), "temperature", self.temperature,
                   "0 or 1 with beam_width (beams are ranked by their logprobs, never sampled)")
            _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1 with beam_width")
            _check(not self.has_penalties, "repetition_penalty", self.repetition_penalty,
                   "unset with beam_width, as frequency_penalty and presence_penalty (no penalties on beams)")
            _check(self.n == 1, "n", self.n, "1 with beam_width (the beams are the results)")
            _check(not self.stop, "stop", self.stop, "unset with beam_width (stop strings are not matched on beams)")
            _check(self.min_p == 0.0 and self.top_p == 1.0 and self.top_k in (-1, 1), "top_p", self.top_p,
                   "1 with beam_width, and top_k and min_p unset (no sampling filters on beams)")
        grammars = [f for f in ("json_schema", "regex", "ebnf") if getattr(self, f) is not None]
        _check(len(grammars) <= 1, grammars[-1] if grammars else "json_schema", "<set>",
               "alone: json_schema, regex and ebnf exclude each other")
        for f in grammars:
            text = getattr(self, f)
            _check(0 < len(text) <= MAX_GRAMMAR_CHARS, f, f"<{len(text)} characters>",
                   f"a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
            _check_unicode(f, [text])
        _check(self.reasoning_end_id is None or 0 <= self.reasoning_end_id <= INT64_MAX, "reasoning_end_id",
               self.reasoning_end_id, "a non-negative token id")
        _check(not (self.reasoning_end_id is not None and self.beam_width), "reasoning_end_id", self.reasoning_end_id,
               "unset with beam_width (beams apply their grammar from the first token)")
        _check(not (grammars and self.constraint is not None), "constraint", "<trie>",
               f"unset with {grammars[0] if grammars else ''} (one constraint per request)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stops = self.stop or []
        _check(len(stops) <= MAX_STOP_STRS, "stop", f"<{len(stops)} strings>", f"at most {MAX_STOP_STRS} strings")
        _check(all(s for s in stops), "stop", self.stop, "non-empty strings")
        longest = max(map(len, stops), default=0)
        _check(longest <= MAX_STOP_STR_CHARS, "stop", f"<a string of {longest} characters>",
               f"strings of at most {MAX_STOP_STR_CHARS} characters")
        _check_unicode("stop", stops)
        self._check_stop_regex()
        if self.custom_params is not None:
            try:  # it travels to the scheduler as MessagePack: refused here, not inside the engine
                msgspec.msgpack.encode(self.custom_params)
            except Exception:  # noqa: BLE001 - msgspec's TypeError, OverflowError, UnicodeEncodeError
                _check(False, "custom_params", self.custom_params,
                       "a dict of what JSON carries (strings, numbers, bools, null, lists and dicts of them)")

    def _check_stop_regex(self) -> None:
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        patterns = self.stop_regex or []
        _check(len(patterns) <= MAX_STOP_STRS, "stop_regex", f"<{len(patterns)} patterns>",
               f"at most {MAX_STOP_STRS} patterns")
        _check(not (patterns and self.beam_width), "stop_regex", patterns, "unset with beam_width")
        for pat in patterns:
            _check(0 < len(pat) <= MAX_STOP_STR_CHARS, "stop_regex", f"<a pattern of {len(pat)} characters>",
                   f"patterns of 1 to {MAX_STOP_STR_CHARS} characters")
            _check_unicode("stop_regex", [pat])
            try:
                compiled = regex.compile(pat)
            except regex.error as e:
                raise ValueError(f"sampling_params.stop_regex={pat!r} is invalid: {e}") from None
            _check(compiled.fullmatch("") is None, "stop_regex", pat, "a pattern that matches no empty text")

    @property
    def is_greedy(self) -> bool:
        # Beams are never sampled.
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1 or self.beam_width > 0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def return_beams(self) -> int:
        """How many beams a beam request returns."""
        return self.num_return_beams or self.beam_width

    @property
    def stop_strs(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]

    @property
    def stop_regexes(self) -> list[str]:
        return self.stop_regex or []  # type: ignore[return-value]

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def coerce(cls, value: SamplingParams | dict[str, Any] | None,
               defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Accept a SamplingParams, a plain dict, or None (defaults). `defaults` (from the
        model's generation config) fill the fields a dict or None leaves unset; a
        SamplingParams instance is taken as fully set."""
        if isinstance(value, cls):
            return value
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")
        if defaults and not value.get("beam_width"):  # a model's sampling defaults mean nothing to beams
            value = {**{k: v for k, v in defaults.items() if k not in value}, **value}
        try:
            return msgspec.convert(value, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling_params: {e}") from None


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"sampling_params.{field}={value!r} is invalid: must be {allowed}")


def is_unicode(text: str) -> bool:
    """Whether `text` is valid Unicode (a Python str may hold lone surrogates, which no
    encoding carries)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_unicode(field: str, texts: list[str]) -> None:
    for t in texts:
        _check(is_unicode(t), field, t, "valid Unicode text (no lone surrogates)")
