"""Where an engine's model files are: the model path a caller gave (or the default
model), and a tokenizer loaded in the caller's process for the caller's own use
(`AsyncEngine.tokenizer`, an attached engine's tokenizer). Blocking file work:
callers on a loop run it on a thread."""

from __future__ import annotations

import os
from typing import Any

from sgl.core.server_args import ServerArgs
from sgl.runtime.chat_template import apply_chat_template_arg


def resolve_model_path(args: ServerArgs) -> str:
    if args.model_path is not None:
        if not os.path.exists(args.model_path):
            raise FileNotFoundError(
                f"model_path={args.model_path!r} does not exist: pass a Hugging Face model directory or a .gguf file"
            )
        return args.model_path
    from sgl.sched.models.default_model import default_model_dir

    return default_model_dir()


def load_tokenizer(path: str, trust_remote_code: bool, chat_template: str | None) -> Any:
    """A Hugging Face tokenizer with the user's chat template, if any."""
    from sgl.sched.models.tokenizer import load_tokenizer as load

    tokenizer = load(path, trust_remote_code)
    apply_chat_template_arg(tokenizer, chat_template)
    return tokenizer
