"""Chat templates given by the user (`chat_template`: a Jinja template, or a file
holding one), checked once at start-up so that a typo fails the start, not the
first chat request. It reads files and parses Jinja; it never renders a template
and never touches a tokenizer it is not handed."""

from __future__ import annotations

import os
from typing import Any

_JINJA_MARKS = ("{%", "{{")


def load_chat_template(value: str) -> str:
    """The template's text: `value` itself when it holds Jinja markup, else the
    contents of the file it names. A ValueError names the field otherwise."""
    if any(mark in value for mark in _JINJA_MARKS):
        text = value
    elif os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    else:
        raise ValueError(f"chat_template={value!r} is invalid: no such file, and not a Jinja template "
                         "(one holds '{%' or '{{')")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is invalid: Jinja syntax error on line {e.lineno}: {e.message}") from None
    return text


def apply_chat_template_arg(tokenizer: Any, value: str | None) -> None:
    """Give `tokenizer` the user's template, when there is one (and a tokenizer)."""
    if value is not None and tokenizer is not None:
        tokenizer.chat_template = load_chat_template(value)
