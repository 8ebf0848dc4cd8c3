"""A GGUF file's model as a Hugging Face folder (config, safetensors weights, tokenizer), for
an engine that serves only those, so that it runs the same weights as `sgl serve FILE.gguf`.

transformers reads the file and dequantizes its tensors (for SmolLM2's Q4_1 file, with
transformers 5.24, to exactly the float32 tensors of sgl's own GGUF reader); they are saved
in `--dtype` (bfloat16 by default, what both engines serve on a GPU), each checked against
the shape the architecture gives it. The tokenizer is the GGUF's own, read as sgl reads it,
with the file's chat template if transformers leaves it out. The folder is written next to
its destination and renamed into place, so a run cut short leaves none behind.

    python -m benchmarks.gguf_to_hf SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-hf [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time


def chat_template_of(gguf_path: str) -> str | None:
    """The chat template stored in the GGUF file's metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).get_field("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode()


def convert(gguf_path: str, out: str, dtype: str = "bfloat16") -> None:
    """Write the model of `gguf_path` into the folder `out` (which must not exist yet)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype, local_files_only=True)
        config = model.config
        # transformers 5 marks a model read from GGUF as quantized and will not save it; its
        # tensors are plain after dequantization, so they are saved here, and the config must
        # not tell the next reader that the weights are GGUF.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]  # what an engine picks its model class by
        tensors = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)  # the embedding's own storage: one copy, as HF saves it
        with torch.device("meta"):
            expected = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
        wrong = [k for k, v in tensors.items() if expected.get(k) != v.shape]
        missing = [k for k in expected if k not in tensors and k != "lm_head.weight"]
        if wrong or missing:
            raise ValueError(f"{gguf_path}: tensors not as {type(model).__name__} has them "
                             f"(other shapes: {wrong[:4]}, missing: {missing[:4]})")
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = chat_template_of(gguf_path)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private, and safetensors' file too
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", help="the .gguf file")
    ap.add_argument("out", help="the folder to write (left as it is when it exists)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = ap.parse_args(argv)
    if os.path.exists(a.out):
        print(f"{a.out} exists: left as it is")
        return 0
    t0 = time.perf_counter()
    convert(a.gguf, a.out, a.dtype)
    print(f"{a.gguf} -> {a.out} ({a.dtype}) in {time.perf_counter() - t0:.1f} s: {' '.join(sorted(os.listdir(a.out)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
