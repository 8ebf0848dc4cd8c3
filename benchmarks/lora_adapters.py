"""Random LoRA adapters in PEFT's format, and the multi-LoRA workload's inputs: what
benchmarks/lora_gpu.py (sgl) and benchmarks/vllm_lora.py (vLLM) both read, so the two
engines get the same adapters and the same prompts. Imports neither engine.

An adapter is a folder as PEFT's `save_pretrained` writes it: `adapter_config.json`
(LORA, rank r, lora_alpha 2r, the seven projections q/k/v/o and gate/up/down, no bias)
and `adapter_model.safetensors` with `base_model.model.model.layers.{i}.self_attn.q_proj
.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]) per layer and projection.
A and B are both drawn from Normal(0, std) (lora_B is not zero, unlike a fresh PEFT
adapter), so each adapter really changes the model's outputs, and each is seeded apart
from the others. Adapter i is named `lora{i}`.

    python -m benchmarks.lora_adapters OUTDIR --config qwen3-0.6b --count 32 [--rank 16]
        [--seed 0] [--std 0.02] [--dtype bfloat16] [--check]

--config: a model directory (its config.json), a config.json, or a name of
benchmarks/configs. A folder already holding the same adapters (spec.json) is kept.
--check loads each adapter with PEFT (`PeftModel.from_pretrained` on the architecture,
its weights left uninitialised) and fails on any missing or unexpected key, or on values
PEFT holds other than the file's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from benchmarks.common import random_prompts

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT_VOCAB = 151000  # as W1
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def load_config(config: str) -> tuple[dict[str, Any], str]:
    """The Hugging Face config that `config` names, and the base model's name for the
    adapters' base_model_name_or_path (the model directory, else the config's name)."""
    if os.path.isdir(config):
        path, base = os.path.join(config, "config.json"), os.path.abspath(config)
    elif os.path.isfile(config):
        path, base = config, os.path.dirname(os.path.abspath(config))
    else:
        path, base = os.path.join(CONFIGS, f"{config}.json"), config
    with open(path) as f:
        return json.load(f), base


def module_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter changes."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
            "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def tensor_name(layer: int, target: str, ab: str) -> str:
    block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{ab}.weight"


def adapter_config(rank: int, base_model: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for LoraConfig(r, 2r, the seven targets)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "revision": None,
            "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(TARGETS),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False}


def default_dir(config: str, rank: int) -> str:
    """Where both engines' benchmarks keep the adapters for an architecture and rank."""
    import tempfile

    name = os.path.basename(os.path.normpath(config)).removesuffix(".json")
    return os.path.join(tempfile.gettempdir(), f"lora-adapters-{name}-r{rank}")


def adapter_names(count: int) -> list[str]:
    return [f"lora{i}" for i in range(count)]


def write_adapter(path: str, cfg: dict[str, Any], rank: int, seed: int, std: float, dtype: str,
                  base_model: str) -> int:
    """One adapter into the folder `path`; returns its parameter count."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    shapes = module_shapes(cfg)
    for layer in range(cfg["num_hidden_layers"]):
        for target in TARGETS:
            n_in, n_out = shapes[target]
            for ab, shape in (("A", (rank, n_in)), ("B", (n_out, rank))):
                t = torch.empty(shape, dtype=getattr(torch, dtype)).normal_(0.0, std, generator=gen)
                tensors[tensor_name(layer, target, ab)] = t
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(rank, base_model), f, indent=2)
    return sum(t.numel() for t in tensors.values())


def write_adapters(outdir: str, config: str, count: int, rank: int = 16, seed: int = 0, std: float = 0.02,
                   dtype: str = "bfloat16") -> dict[str, str]:
    """`count` adapters for the architecture `config` names, in OUTDIR/lora{i}: {name: path}.
    A folder whose spec.json says it holds at least these adapters is kept as it is."""
    outdir = os.path.abspath(outdir)
    cfg, base_model = load_config(config)
    spec = {"shapes": module_shapes(cfg), "layers": cfg["num_hidden_layers"], "rank": rank, "seed": seed,
            "std": std, "dtype": dtype, "targets": list(TARGETS)}
    spec = json.loads(json.dumps(spec))  # tuples as lists, as read back
    names = adapter_names(count)
    paths = {n: os.path.join(outdir, n) for n in names}
    spec_path = os.path.join(outdir, "spec.json")
    try:
        with open(spec_path) as f:
            old = json.load(f)
        if old.pop("count", 0) >= count and old == spec and all(
                os.path.isfile(os.path.join(p, "adapter_model.safetensors")) for p in paths.values()):
            print(f"{count} adapters already in {outdir}", flush=True)
            return paths
    except (OSError, ValueError):
        pass
    os.makedirs(outdir, exist_ok=True)
    if os.path.exists(spec_path):
        os.remove(spec_path)  # written last: a run cut short leaves no spec behind
    t0 = time.perf_counter()
    params = 0
    for i, name in enumerate(names):
        params = write_adapter(paths[name], cfg, rank, seed * 100_003 + i, std, dtype, base_model)
    with open(spec_path, "w") as f:
        json.dump({**spec, "count": count}, f, indent=1)
    print(f"wrote {count} adapters (rank {rank}, {params / 1e6:.1f}M parameters each, {dtype}) in {outdir} in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return paths


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The flags both engines' multi-LoRA benchmarks take: the workload and the adapters."""
    ap.add_argument("--adapters", default="0,1,8,32", help="comma list of adapter counts; 0 is the base model alone")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--config", default="qwen3-0.6b",
                    help="an architecture of benchmarks/configs (vllm_lora.py: or a config.json)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per engine; the median is reported")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapter-dir", default=None,
                    help="where the adapters are (written there first when absent); default: "
                         "/tmp/lora-adapters-CONFIG-rRANK")


def workload(requests: int, input_len: int, output_len: int, adapters: int) -> tuple[
        list[list[int]], list[int], list[str | None]]:
    """W1's prompts (random_prompts(requests, input_len, 151000), seed 0), each request's
    new tokens, and its adapter: round-robin over the first `adapters`, None (the base
    model) for every request when `adapters` is 0."""
    names = adapter_names(adapters)
    per_request: list[str | None] = [names[i % adapters] if adapters else None for i in range(requests)]
    return random_prompts(requests, input_len, PROMPT_VOCAB), [output_len] * requests, per_request


def warmup_requests(adapters: int) -> int:
    """Requests in a variant's warm-up: at least 8, and one per adapter at least, so that
    every adapter is loaded before the timed run."""
    return max(8, adapters)


def check_prompt() -> list[int]:
    """The prompt of the outputs-differ check (not one of the workload's)."""
    return random_prompts(1, 64, PROMPT_VOCAB, seed=7)[0]


def check_with_peft(path: str, config: str) -> list[str]:
    """Load the adapter at `path` with PEFT onto the architecture of `config` (its base
    weights uninitialised); the problems found, [] when PEFT takes it as it is."""
    import logging
    import warnings

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, _ = load_config(config)
    hf_cfg = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")  # uninitialised: untouched pages cost no memory
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    handler = Keep()
    loggers = [logging.getLogger(n) for n in ("peft", "transformers")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peft_model = PeftModel.from_pretrained(model, path)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    problems = [f"warning: {m}" for m in records + [str(w.message) for w in caught]
                if any(k in m.lower() for k in ("missing", "unexpected", "mismatch", "not found"))]
    lc = LoraConfig.from_pretrained(path)
    with open(os.path.join(path, "adapter_config.json")) as f:
        rank = int(json.load(f)["r"])
    if (lc.r, lc.lora_alpha, set(lc.target_modules or ())) != (rank, 2 * rank, set(TARGETS)):
        problems.append(f"config read back as r={lc.r}, alpha={lc.lora_alpha}, targets={lc.target_modules}")
    saved = load_file(os.path.join(path, "adapter_model.safetensors"))
    held = get_peft_model_state_dict(peft_model)
    if set(saved) != set(held):
        problems.append(f"keys: {sorted(set(saved) - set(held))[:4]} only in the file, "
                        f"{sorted(set(held) - set(saved))[:4]} only in PEFT's model")
    for k in sorted(set(saved) & set(held)):
        if tuple(saved[k].shape) != tuple(held[k].shape):
            problems.append(f"{k}: {tuple(saved[k].shape)} in the file, {tuple(held[k].shape)} in PEFT's model")
        elif not torch.equal(saved[k], held[k].to(saved[k].dtype)):
            problems.append(f"{k}: PEFT holds other values than the file's")
    if not any(k.endswith("lora_B.weight") and bool(v.abs().sum() > 0) for k, v in saved.items()):
        problems.append("every lora_B is zero: the adapter would change nothing")
    print(f"peft: {path}: {len(saved)} tensors onto {cfg['architectures'][0]}: {'FAIL' if problems else 'OK'}",
          flush=True)
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--config", default="qwen3-0.6b",
                    help="a model directory, a config.json, or a name of benchmarks/configs")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of lora_A and lora_B entries")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--check", action="store_true", help="load each adapter with PEFT and report any problem")
    a = ap.parse_args()
    paths = write_adapters(a.outdir, a.config, a.count, a.rank, a.seed, a.std, a.dtype)
    if not a.check:
        return 0
    failed = 0
    for name, path in paths.items():
        problems = check_with_peft(path, a.config)
        failed += bool(problems)
        for p in problems:
            print(f"  {name}: {p}")
    print(f"peft check: {len(paths) - failed} of {len(paths)} adapters load cleanly")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
