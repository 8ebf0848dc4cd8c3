"""A JSON schema rewritten before xgrammar compiles it, where xgrammar's output could
otherwise break the schema or JSON itself.

xgrammar 0.2.9 turns a string with `minLength`/`maxLength` (and no `pattern`) into
`"` [^"\\\r\n]{min,max} `"`: raw control characters (U+0000-U+001F, tab and the like)
pass, and a JSON string may not hold them unescaped (RFC 8259, section 7), so
`json.loads` refuses the output. A `pattern` goes through xgrammar's JSON-string
regex instead, which keeps them out. So each such string becomes the same length
bound as a pattern, `^[\\s\\S]{min,max}$`: any character, counted as JSON Schema counts
(code points). Escapes are not allowed in either form, so the outputs are the same
but for the control characters.

Left as xgrammar takes it: a string with both `pattern` and a length bound (xgrammar
keeps the pattern and drops the bound; two regular expressions do not intersect here).

It reads and writes schemas only; it compiles nothing."""

from __future__ import annotations

import json
from typing import Any

# Keywords whose values are data (or annotations), never schemas: nothing in them is rewritten.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example", "title", "description"})
# Keywords whose values map names to schemas: the names are not keywords.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def for_xgrammar(text: str) -> str:
    """The schema `text` with every length-bounded string as a pattern; `text` itself
    when nothing needs it (or when it is not JSON: xgrammar's error is the caller's)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    out, changed = _schema(schema)
    return json.dumps(out) if changed else text


def _schema(node: Any) -> tuple[Any, bool]:
    """A schema (or a list of them, or a value of an unknown keyword) rewritten."""
    if isinstance(node, list):
        items = [_schema(x) for x in node]
        return [x for x, _ in items], any(c for _, c in items)
    if not isinstance(node, dict):
        return node, False
    changed = False
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _DATA_KEYS:
            out[k] = v
        elif k in _NAMED_SCHEMAS and isinstance(v, dict):
            named = {name: _schema(sub) for name, sub in v.items()}
            out[k] = {name: sub for name, (sub, _) in named.items()}
            changed |= any(c for _, c in named.values())
        else:
            out[k], c = _schema(v)
            changed |= c
    if _bounded_plain_string(out):
        lo = int(out.pop("minLength", 0))
        hi = out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{lo},{'' if hi is None else int(hi)}}}$"
        changed = True
    return out, changed


def _bounded_plain_string(node: dict[str, Any]) -> bool:
    return (node.get("type") == "string" and ("minLength" in node or "maxLength" in node)
            and not {"pattern", "format", "enum", "const"} & node.keys()
            and all(isinstance(node.get(k, 0), int) and not isinstance(node.get(k, 0), bool)
                    for k in ("minLength", "maxLength")))
