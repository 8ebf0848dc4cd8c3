"""What a fake engine writes for a grammar request (sgl/testing/scripted.py): the
responder's text if it matches the grammar, else a short text written from the grammar
by characters; a grammar that does not compile refuses the request with a 400, as the
scheduler's compile does. JSON Schema and regexes are checked without xgrammar where
they can be (so without torch)."""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections import Counter
from typing import Any

from sgl.core.protocol import GRAMMAR_EMPTY, GRAMMAR_UNCOMPILED, FinishReason

MAX_JSON_WHITESPACE = 2  # as the scheduler compiles json_schema (sgl.sched.grammar)


class Refused(Exception):
    """A request the scheduler ends on arrival, with `reason` (its finish reason)."""

    def __init__(self, reason: FinishReason) -> None:
        super().__init__(reason["message"])
        self.reason = reason


def grammar_text(kind: str, grammar: str, text: str, budget: int) -> str:
    """`text` if it matches the grammar (JSON Schema and regexes checked without xgrammar,
    so without torch), else one written from it; Refused with status_code 400 if invalid."""
    if kind == "json_schema" and _json_matches(grammar, text):
        return text
    if kind == "regex":
        with contextlib.suppress(re.error):  # a dialect Python lacks: xgrammar decides below
            if re.fullmatch(grammar, text):
                return text
    import xgrammar as xgr

    compiled = _compiled(kind, grammar)
    if kind == "ebnf" and (m := xgr.GrammarMatcher(compiled)).accept_string(text) and m.is_completed():
        return text
    if _matches_nothing(xgr.GrammarMatcher(compiled), grammar):  # as the scheduler's compile refuses it
        raise Refused({"type": "abort", "status_code": 400, "message": f"{kind}: {GRAMMAR_EMPTY}"})
    return _write(xgr.GrammarMatcher(compiled), grammar, budget)


def _matches_nothing(matcher: Any, grammar: str) -> bool:
    """Whether the grammar can neither end at once nor take a first character (of the first
    256 code points and its own): it matches no text."""
    if matcher.is_completed():
        return False
    chars = [chr(c) for c in range(256)] + sorted({c for c in grammar if ord(c) > 255})
    return not any(matcher.accept_string(c) for c in chars)  # a refused one leaves the matcher as it was


def _invalid(kind: str, why: str) -> Refused:
    return Refused({"type": "abort", "status_code": 400, "message": f"{kind}: {GRAMMAR_UNCOMPILED}: {why}"})


def _json_matches(grammar: str, text: str) -> bool:
    import jsonschema  # type: ignore[import-untyped]

    try:
        schema = json.loads(grammar)
        validator = jsonschema.validators.validator_for(schema)
        validator.check_schema(schema)
    except (ValueError, jsonschema.SchemaError) as e:
        raise _invalid("json_schema", getattr(e, "message", str(e))) from None
    try:
        return bool(validator(schema).is_valid(json.loads(text)))
    except ValueError:
        return False


@functools.lru_cache(maxsize=32)
def _compiled(kind: str, grammar: str) -> Any:
    """Compiled as the scheduler compiles it, over no vocabulary (text is written by characters)."""
    import xgrammar as xgr

    from sgl.sched.json_schema_rewrite import for_xgrammar

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(for_xgrammar(grammar), max_whitespace_cnt=MAX_JSON_WHITESPACE)
        return compiler.compile_regex(grammar) if kind == "regex" else compiler.compile_grammar(grammar)
    except Exception as e:  # noqa: BLE001 - the caller's grammar: their 400
        raise _invalid(kind, re.sub(r"^\[[\d:]+\] \S+: ", "", str(e).strip())[:500]) from None


_CLOSERS = '"}]'
_ASCII = [chr(c) for c in range(33, 127)]


def _write(matcher: Any, grammar: str, budget: int) -> str:
    """A short text in the grammar, at most `budget` characters, deterministic: it ends as
    soon as the grammar may end; until then each character is the first the grammar takes
    of closing quotes and brackets, the least used yet of printable ASCII and the grammar's
    own non-ASCII characters, then a space or a newline."""
    chars = _ASCII + sorted({c for c in grammar if not c.isascii() and c.isprintable()})
    uses: Counter[str] = Counter()
    out: list[str] = []
    while len(out) < budget and not matcher.is_completed():
        order = sorted(chars, key=lambda c: (_CLOSERS.find(c) % (len(_CLOSERS) + 1), uses[c], c))
        c = next((c for c in [*order, " ", "\n"] if matcher.accept_string(c)), None)
        if c is None:
            break
        out.append(c)
        uses[c] += 1
    return "".join(out)
