"""Loading a Hugging Face tokenizer, the one way every role does it (the tokenizer's
process, the scheduler's stop strings and grammar compiler, a caller asking for a
copy): from a model directory or a .gguf file, offline (local_files_only: nothing is
fetched and no global setting such as HF_HUB_OFFLINE is touched), with the user's
chat template (`chat_template`: a Jinja template, or a file holding one) in place
of the tokenizer's own. The template is checked as it loads, so a typo fails the
engine's start, not its first chat request.

Blocking file work (transformers is imported on the first call); it never renders a
template."""

from __future__ import annotations

import os
from typing import Any

_JINJA_MARKS = ("{%", "{{")


def load_tokenizer(path: str, trust_remote_code: bool = False, chat_template: str | None = None) -> Any:
    """The tokenizer at `path` (a model directory or a .gguf file), with `chat_template` if given."""
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        d, name = os.path.split(os.path.abspath(path))
        tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
    elif os.path.isdir(path):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    else:
        raise FileNotFoundError(
            f"model path {path!r} is not a directory: pass a Hugging Face model directory or a .gguf file"
        )
    if chat_template is not None:
        tokenizer.chat_template = load_chat_template(chat_template)
    return tokenizer


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
