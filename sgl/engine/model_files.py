"""Where an engine's model files are: the model path a caller gave, or the default
model's. Blocking file work: callers on a loop run it on a thread."""

from __future__ import annotations

import os

from sgl.core.server_args import ServerArgs


def resolve_model_path(args: ServerArgs) -> str:
    if args.model_path is not None:
        if not os.path.exists(args.model_path):
            raise FileNotFoundError(
                f"model_path={args.model_path!r} does not exist: pass a Hugging Face model directory or a .gguf file"
            )
        return args.model_path
    from sgl.sched.models.default_model import default_model_dir

    return default_model_dir()
