"""Loading Hugging Face tokenizers from a model directory or a .gguf file, offline
(local_files_only: nothing is fetched and no global setting such as HF_HUB_OFFLINE
is touched)."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        d, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model path {path!r} is not a directory: pass a Hugging Face model directory or a .gguf file"
        )
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
