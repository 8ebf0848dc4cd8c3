"""Stop strings and regex stops, found by the scheduler in the text of a window of each request's
newest output tokens. The tokenizer is loaded on the first request that has stop
strings. This module decides only whether a request stopped; trimming the text
is the detokenizer's job."""

from __future__ import annotations

from typing import Any

from sgl.core.stop_rule import earliest_ending_after, earliest_regex_ending_after
from sgl.sched.models.tokenizer import load_tokenizer

# Extra tokens decoded beyond the longest stop string's length in characters: a
# token decodes to at least one character except at broken multi-byte boundaries.
WINDOW_SLACK = 4
# Tokens of text a regex stop is matched against: a match must fit in them.
REGEX_WINDOW = 64


class StopStrings:
    def __init__(self, tokenizer_path: str | None, trust_remote_code: bool) -> None:
        self.path = tokenizer_path
        self.trust_remote_code = trust_remote_code
        self._tokenizer: Any = None

    @property
    def available(self) -> bool:
        return self.path is not None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            assert self.path is not None
            self._tokenizer = load_tokenizer(self.path, self.trust_remote_code)
        return self._tokenizer

    def match(self, output_ids: list[int], stops: list[str], skip_special_tokens: bool,
              regexes: list[str] | None = None) -> str | None:
        """The stop string whose earliest occurrence ends in the newest token's text (else
        the text a regex stop matched there), or None. Only such occurrences count (vLLM's
        rule): the steps before were checked already, or came before min_new_tokens, where
        stops do not apply. TimeoutError: a regex too slow to match."""
        window = max((len(s) for s in stops), default=0) + WINDOW_SLACK
        if regexes:
            window = max(window, REGEX_WINDOW)
        tok = self.tokenizer()
        ids = output_ids[-window:]
        text = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        before = len(tok.decode(ids[:-1], skip_special_tokens=skip_special_tokens))
        found = earliest_ending_after(text, stops, before) if stops else None
        if found is None and regexes:
            found = earliest_regex_ending_after(text, regexes, before)
        return found

