"""Which occurrence of a stop string ends a request, in one place for the two sides
that need it: the scheduler stops a request when a stop string's occurrence ends in
the text of the newest token (vLLM's rule: earlier text was checked at earlier steps,
or came before min_new_tokens, where stop strings do not apply), and the
detokenizer trims the final text at that same occurrence. Regex stops follow the
same rule; the detokenizer trims at the text a regex matched. Pure functions on text."""

from __future__ import annotations

import regex

# Matching a caller's pattern is bounded in time: a pathological one (nested repeats)
# must not stall the scheduler's loop.
REGEX_TIMEOUT_S = 0.05


def earliest_ending_after(text: str, stops: list[str], before: int) -> str | None:
    """The stop string with the earliest occurrence in `text` that ends after position
    `before` (the length of the text that was there already), or None."""
    found = [(at, s) for s in stops if (at := text.find(s, max(0, before - len(s) + 1))) >= 0]
    return min(found)[1] if found else None


def stop_cut(text: str, stop: str, before: int) -> int:
    """Where to trim `text` at `stop`: its earliest occurrence that ends after `before`
    (the one that stopped generation), else its last one; -1 if there is none."""
    at = text.find(stop, max(0, before - len(stop) + 1))
    return at if at >= 0 else text.rfind(stop)


def earliest_regex_ending_after(text: str, patterns: list[str], before: int) -> str | None:
    """The text of the earliest non-empty match of any of `patterns` in `text` that ends
    after position `before`, or None. TimeoutError when a pattern takes longer than
    REGEX_TIMEOUT_S on this text."""
    found: list[tuple[int, str]] = []
    for pat in patterns:
        for m in regex.finditer(pat, text, overlapped=True, timeout=REGEX_TIMEOUT_S):
            if m.end() > before and m.end() > m.start():
                found.append((m.start(), m.group()))
                break
    return min(found)[1] if found else None
