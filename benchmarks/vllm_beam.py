"""vLLM's `LLM.beam_search` on the W6 shapes (BENCHMARKS.md): the vLLM peer of
benchmarks/w6_beam.py, on the same H200, with the same inputs.

Qwen3-0.6B architecture (benchmarks/configs/qwen3-0.6b.json), dummy bf16 weights
(load_format="dummy"), vLLM's defaults otherwise (as the vLLM peer in ../shared/peers/vllm runs it).
Shapes, in w6_beam's order and with its prompts (random_prompts(requests, input_len,
151000, seed=60 + shape index)): widths 8, 64 and 200, 128 requests x 256 input ids,
64 new tokens, `BeamSearchParams(beam_width=W, max_tokens=64, ignore_eos=True,
length_penalty=1.0)`; then the seed's shape, width 200 and 3 new tokens, WITHOUT the
trie: `LLM.beam_search` takes no logits processor or constraint, so vLLM can only run
the unconstrained search of that shape (say so wherever the number is quoted).

vLLM's beam search asks each step for 2 W logprobs per beam, so the engine gets
max_logprobs = 2 x the widest width. It decodes the beams' text at the end, so the
model folder gets a synthetic word-level tokenizer (one word per id) unless
--skip-tokenizer-init. Per shape: a warm-up of 2 requests (other prompts), a prefix
cache reset, then one timed `beam_search` over all requests.
Throughput = requests x W x new tokens / wall time (beam-tokens/s), as w6_beam counts it.

On the GPU host, with the vLLM peer unpacked into /tmp/vllm-site (its parts brought
along in two commands, ../shared/peers/vllm/README.md; then, while the host is warm):

    eval "$(bash .peer/vllm/kit/unpack.sh .peer/vllm)" && python3 -m benchmarks.vllm_beam \\
        [--widths 8,64,200] [--requests 128] [--input-len 256] [--output-len 64] [--no-trie-shape]
        [--trie-width 200] [--skip-tokenizer-init] [--llm-kwargs JSON] [--json OUT.json]

The last line printed is `RESULT name=W6_vllm w8=<beam-tok/s> ... trie200=<beam-tok/s>`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from typing import Any

from benchmarks.common import Shape, random_prompts, table

PROMPT_VOCAB = 151000  # as benchmarks/w6_beam.py (and W1, W3)
WARMUP_REQUESTS = 2
# As the vLLM peer's bench.py sets them (only where unset); none changes what is computed.
ENGINE_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CACHE_ROOT": "/tmp/vllm-cache",
    "PYTHONUNBUFFERED": "1",
}


def log(*a: object) -> None:
    print(*a, flush=True)


def model_dir(with_tokenizer: bool) -> str:
    """config.json (Qwen3-0.6B architecture), a generation_config.json of the special ids
    only (no sampling defaults), and optionally a synthetic tokenizer."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3-0.6b.json")
    with open(src) as f:
        cfg = json.load(f)
    d = os.path.join(tempfile.gettempdir(), "vllm-peer-w6-qwen3-0.6b" + ("-tok" if with_tokenizer else ""))
    os.makedirs(d, exist_ok=True)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id")}
    for name, obj in (("config.json", cfg), ("generation_config.json", gen)):
        with open(os.path.join(d, name), "w") as f:
            json.dump(obj, f, indent=1)
    if with_tokenizer and not os.path.exists(os.path.join(d, "tokenizer.json")):
        write_tokenizer(d, cfg["vocab_size"], cfg["eos_token_id"], cfg["bos_token_id"])
    return d


def write_tokenizer(d: str, vocab: int, eos: int, bos: int) -> None:
    """A word-level tokenizer with one word "t<id>" per id: enough for vLLM to decode the
    beams' text and to know EOS (ignored here anyway)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{eos}", bos_token=f"t{bos}")
    fast.save_pretrained(d)


def shapes_of(a: argparse.Namespace) -> list[Shape]:
    out = [Shape("W6", w, a.requests, a.input_len, a.output_len) for w in a.widths]
    if not a.no_trie_shape:
        out.append(Shape("W6 trie shape, no trie", a.trie_width, a.requests, a.input_len, 3))
    return out


def beam_search_params(width: int, max_tokens: int) -> Any:
    try:
        from vllm.beam_search import BeamSearchParams  # type: ignore[import-not-found]
    except ImportError:  # where older and newer vLLMs keep it
        from vllm.sampling_params import BeamSearchParams  # type: ignore[import-not-found]
    return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True, length_penalty=1.0)


def key_of(s: Shape) -> str:
    return f"{'w' if s.workload == 'W6' else 'trie'}{s.width}"


def run_shape(llm: Any, s: Shape, index: int) -> tuple[dict[str, object], float]:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(s.requests, s.input_len, PROMPT_VOCAB, seed=60 + index)]
    warm = [{"prompt_token_ids": p}
            for p in random_prompts(WARMUP_REQUESTS, s.input_len, PROMPT_VOCAB, seed=90 + index)]
    params = beam_search_params(s.width, s.output_len)
    tw = time.perf_counter()
    llm.beam_search(warm, params)
    llm.reset_prefix_cache()
    warm_s = time.perf_counter() - tw
    t0 = time.perf_counter()
    outs = llm.beam_search(prompts, params)
    dt = time.perf_counter() - t0
    assert len(outs) == s.requests, f"{len(outs)} outputs for {s.requests} requests"
    lens = {len(q.tokens) - s.input_len for o in outs for q in o.sequences}
    beams = [len(o.sequences) for o in outs]
    if lens != {s.output_len} or set(beams) != {s.width}:
        log(f"[vllm-beam] WARNING {s.workload} width {s.width}: new-token lengths {sorted(lens)}, beams per "
            f"request {sorted(set(beams))} (asked {s.output_len} and {s.width})")
    rate = s.requests * s.width * s.output_len / dt
    log(f"[vllm-beam] {s.workload} width {s.width}: {dt:.2f} s, {rate:,.0f} beam-tok/s, warm-up {warm_s:.1f} s")
    return {"workload": s.workload, "width": s.width, "out": s.output_len, "requests": s.requests,
            "seconds": f"{dt:.3f}", "beam-tok/s": rate}, rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="8,64,200", help="comma list of beam widths")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--trie-width", type=int, default=200, help="width of the seed's shape (3 new tokens)")
    ap.add_argument("--no-trie-shape", action="store_true", help="skip the seed's shape")
    ap.add_argument("--skip-tokenizer-init", action="store_true",
                    help="no tokenizer (vLLM's beam search may need one to decode the beams)")
    ap.add_argument("--llm-kwargs", default=None, help="JSON dict of extra LLM(...) arguments")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args()
    a.widths = [int(w) for w in a.widths.split(",") if w]
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    shapes = shapes_of(a)

    import vllm  # type: ignore[import-not-found]
    from vllm import LLM

    kw: dict[str, Any] = dict(model=model_dir(not a.skip_tokenizer_init), load_format="dummy", dtype="bfloat16",
                              gpu_memory_utilization=0.85, seed=0, skip_tokenizer_init=a.skip_tokenizer_init,
                              max_logprobs=2 * max(s.width for s in shapes))
    if a.llm_kwargs:
        kw.update(json.loads(a.llm_kwargs))
    log(f"[vllm-beam] vllm {vllm.__version__}; LLM({', '.join(f'{k}={v!r}' for k, v in kw.items())})")
    t0 = time.perf_counter()
    llm = LLM(**kw)
    log(f"[vllm-beam] start-up {time.perf_counter() - t0:.1f} s")
    rows: list[dict[str, object]] = []
    rates: dict[str, float] = {}
    for i, s in enumerate(shapes):
        try:
            row, rates[key_of(s)] = run_shape(llm, s, i)
            rows.append(row)
        except Exception as e:  # noqa: BLE001 (report it and go on with the next shape)
            traceback.print_exc()
            log(f"[vllm-beam] ERROR {s.workload} width {s.width}: {e!r}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if rows:
        log(table(rows))
    log("RESULT name=W6_vllm " + " ".join(f"{k}={rates[k]:.0f}" if k in rates else f"{k}=nan"
                                          for k in map(key_of, shapes)))
    return 0 if len(rows) == len(shapes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
