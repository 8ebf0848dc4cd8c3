"""W6 (BENCHMARKS.md): beam search on a GPU, Qwen3-0.6B architecture, dummy bf16 weights.

Shapes: widths 8, 64 and 200; 128 requests x 256 random input ids, 64 output tokens
(EOS banned with min_new_tokens, so every beam has the same length); and the seed's
shape: width 200, 3 new tokens under a trie of 100k random 3-token sequences.

Two ways on the same engine, one after the other (each after a cache flush and a warm-up):
- native: one beam request per prompt (`beam_width`), all requests at once through AsyncEngine;
- loop: the seed's user-side loop (what SGLang users do today): per request and step, one
  batched generate call holding one request per beam (prompt + the beam's ids),
  max_new_tokens=1, return_logprob=True, top_logprobs_num=W (+1, to step over EOS; at most
  the engine's bound, which makes the loop approximate for wider beams but not cheaper),
  or under the trie token_ids_logprob=the node's children (256 a request; the root's
  ~97k children take many), detokenize=False; the best W candidates are picked in
  Python. All requests' loops run at once. It makes about 1 + (steps - 1) x W requests
  per request, so it runs only as many requests as fit --loop-max-calls (at least one).
Throughput = beams x new tokens requested / wall time (beam-tokens/s); native/loop is
the ratio of the two throughputs. "agree" is the share of the loop's requests whose best
beam equals the native one (informational: dummy weights make near ties).

    python -m benchmarks.w6_beam [--widths 8,64,200] [--requests 128] [--input-len 256] [--output-len 64]
        [--trie-width 200] [--trie-sequences 100000] [--no-trie] [--no-loop] [--no-native]
        [--loop-max-calls 200000] [--max-running 1024]
    python -m benchmarks.w6_beam --cpu-small   # 8 x 32 in, 8 out, widths 4 and 8, a tiny random Llama on CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from typing import Any

import sgl
from benchmarks.common import Shape, dummy_model_dir, machine, random_prompts, table

PROMPT_VOCAB = 151000  # prompt ids are drawn from [100, PROMPT_VOCAB), as in W1 and W3
MAX_TOKEN_IDS_LOGPROB = 256  # sgl.core.request_checks: the most ids token_ids_logprob may name
TRIE_NAME = "w6-trie"
# --cpu-small: a tiny Llama, random weights (load_format="dummy"), float32 on the CPU.
CPU_SMALL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "eos_token_id": 511, "bos_token_id": 0, "tie_word_embeddings": False,
}


class TrieIndex:
    """Children of every prefix of a set of sequences (the loop's own view of the trie)."""

    def __init__(self, seqs: list[list[int]]) -> None:
        self.children: dict[tuple[int, ...], set[int]] = {}
        for s in seqs:
            for i in range(len(s)):
                self.children.setdefault(tuple(s[:i]), set()).add(s[i])

    def allowed(self, prefix: list[int]) -> set[int]:
        return self.children.get(tuple(prefix), set())


def random_trie(n: int, length: int, vocab: int, seed: int = 7, low: int = 100) -> list[list[int]]:
    """n distinct random sequences of `length` ids in [low, vocab)."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    while len(seen) < n:
        seen.add(tuple(rng.randrange(low, vocab) for _ in range(length)))
    return [list(s) for s in sorted(seen)]


def cpu_small_model_dir() -> str:
    d = os.path.join(tempfile.gettempdir(), "sgl-bench-w6-cpu-small")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CPU_SMALL_CONFIG, f)
    return d


def eos_ids(model_dir: str) -> set[int]:
    with open(os.path.join(model_dir, "config.json")) as f:
        eos = json.load(f).get("eos_token_id")
    return set(eos) if isinstance(eos, list) else {eos} if isinstance(eos, int) else set()


def native_params(s: Shape, register: bool = False) -> dict[str, Any]:
    p: dict[str, Any] = {"beam_width": s.width, "max_new_tokens": s.output_len, "temperature": 0}
    if s.trie is None:
        p["min_new_tokens"] = s.output_len
    else:  # the warm-up sends the sequences once; the measured requests name the kept trie
        p["constraint"] = {"type": "trie", "name": TRIE_NAME, **({"sequences": s.trie} if register else {})}
    return p


async def run_native(e: sgl.AsyncEngine, s: Shape, prompts: list[list[int]], warm: list[list[int]]
                     ) -> tuple[float, list[list[int]]]:
    await e.flush_cache()
    params = native_params(s)
    await e.generate(input_ids=warm[0], sampling_params=native_params(s, register=True), detokenize=False)
    await asyncio.gather(*(e.generate(input_ids=p, sampling_params=params, detokenize=False) for p in warm[1:]))
    t0 = time.perf_counter()
    outs: list[Any] = await asyncio.gather(*(e.generate(input_ids=p, sampling_params=params, detokenize=False)
                                             for p in prompts))  # each a list of beams, best first
    dt = time.perf_counter() - t0
    for beams in outs:
        assert 1 <= len(beams) <= s.width, f"{len(beams)} beams for width {s.width}"
        assert all(len(b["output_ids"]) == s.output_len for b in beams), [len(b["output_ids"]) for b in beams]
        if s.trie is None:
            assert len(beams) == s.width
    return dt, [beams[0]["output_ids"] for beams in outs]


async def loop_one(e: sgl.AsyncEngine, s: Shape, prompt: list[int], eos: set[int], trie: TrieIndex | None,
                   top_n: int, stats: dict[str, int]) -> list[int]:
    """One request's beam search by hand: a generate call per step, one request per beam.

    A beam asks for its top `top_n` ids, or under the trie for its node's children by id
    (token_ids_logprob, at most 256 a request: a wider node takes several requests, the
    first sent alone so that the rest find the prefix cached) unless top_n >= 4 W."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(s.output_len):
        subs: list[tuple[int, list[int]]] = []  # (beam, ids asked for by id; [] = the top ids)
        for i, (b, _) in enumerate(beams):
            ok = sorted(trie.allowed(b)) if trie is not None else []
            if trie is None or (len(ok) > MAX_TOKEN_IDS_LOGPROB and top_n >= 4 * s.width):
                subs.append((i, []))
            else:
                subs += [(i, ok[j:j + MAX_TOKEN_IDS_LOGPROB]) for j in range(0, len(ok), MAX_TOKEN_IDS_LOGPROB)]
        first = 1 if len(subs) > len(beams) else 0  # a node split over requests: warm its prefix first
        outs: list[Any] = []
        for part in ([subs[:first], subs[first:]] if first else [subs]):
            opts: dict[str, Any] = {"top_logprobs_num": [0 if ids else top_n for _, ids in part]}
            if any(ids for _, ids in part):
                opts["token_ids_logprob"] = [ids or [0] for _, ids in part]
            outs += await e.generate(input_ids=[prompt + beams[i][0] for i, _ in part], return_logprob=True,
                                     detokenize=False, **opts,
                                     sampling_params={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
        cands: list[tuple[float, list[int]]] = []
        for (i, ids), o in zip(subs, outs):
            b, cum = beams[i]
            m = o["meta_info"]
            row = m["output_token_ids_logprobs"][0] if ids else m["output_top_logprobs"][0]
            ok_set = trie.allowed(b) if trie is not None and not ids else None
            cands += [(cum + lp, b + [t]) for lp, t, _ in row if t not in eos and (ok_set is None or t in ok_set)]
        cands.sort(key=lambda c: -c[0])
        beams = [(ids, score) for score, ids in cands[:s.width]]
        stats["calls"] += len(outs)
    return beams[0][0]


async def run_loop(e: sgl.AsyncEngine, s: Shape, prompts: list[list[int]], warm: list[list[int]], eos: set[int],
                   top_n: int) -> tuple[float, list[list[int]], dict[str, int]]:
    trie = TrieIndex(s.trie) if s.trie is not None else None
    stats = {"calls": 0}
    await e.flush_cache()
    await asyncio.gather(*(loop_one(e, s, p, eos, trie, top_n, stats) for p in warm))
    stats = {"calls": 0}
    t0 = time.perf_counter()
    best = await asyncio.gather(*(loop_one(e, s, p, eos, trie, top_n, stats) for p in prompts))
    return time.perf_counter() - t0, list(best), stats


def loop_top_n(s: Shape, cap: int) -> int:
    """Top ids the loop asks for, at most `cap` (the engine's bound): W + 1 (one may be EOS,
    which the loop skips; with fewer the loop is approximate: it may miss candidates, though
    it makes the same calls); under the trie 4 W, so that at least W of them are allowed
    (about 2/3 of all ids start a sequence), else the trie's nodes go by id (exact)."""
    return min(4 * s.width if s.trie is not None else s.width + 1, cap)


def loop_requests(s: Shape, max_calls: int) -> int:
    per_request = 1 + (s.output_len - 1) * s.width
    return max(1, min(s.requests, max_calls // per_request))


async def bench(a: argparse.Namespace) -> None:
    model_dir = cpu_small_model_dir() if a.cpu_small else dummy_model_dir()
    vocab = CPU_SMALL_CONFIG["vocab_size"] - 1 if a.cpu_small else PROMPT_VOCAB
    low = 1 if a.cpu_small else 100
    eos = eos_ids(model_dir)
    shapes = [Shape("W6", w, a.requests, a.input_len, a.output_len) for w in a.widths]
    if not a.no_trie:
        shapes.append(Shape("W6 trie", a.trie_width, a.requests, a.input_len, 3,
                            random_trie(a.trie_sequences, 3, vocab, low=low)))
    native = not a.no_native
    kw: dict[str, Any] = dict(transport="ipc", load_format="dummy", skip_tokenizer_init=True, random_seed=0,
                              max_running_requests=a.max_running,
                              max_top_logprobs_num=max(loop_top_n(s, 1 << 20) for s in shapes),
                              max_queued_requests=None)
    if a.cpu_small:
        kw.update(device="cpu", dtype="float32", max_total_tokens=a.max_total_tokens or 65536)
    elif a.max_total_tokens:
        kw["max_total_tokens"] = a.max_total_tokens
    rows: list[dict[str, object]] = []
    results: list[str] = []
    async with sgl.AsyncEngine(model_dir, **kw) as e:
        # The request checks' bound on top_logprobs_num, as the engine reads it (limits_of).
        cap = int((await e.get_server_info()).get("max_top_logprobs_num", 20))
        for i, s in enumerate(shapes):
            prompts = random_prompts(s.requests, s.input_len, vocab, seed=60 + i, low=low)
            warm = random_prompts(2, s.input_len, vocab, seed=90 + i, low=low)
            work = s.width * s.output_len  # beam-tokens per request
            row: dict[str, object] = {"workload": s.workload, "width": s.width, "out": s.output_len,
                                      "requests": s.requests}
            nat_best: list[list[int]] = []
            nat_rate = 0.0
            key = f"{'trie' if s.trie else 'w'}{s.width}"
            if native:
                dt, nat_best = await run_native(e, s, prompts, warm)
                nat_rate = s.requests * work / dt
                row.update({"native s": f"{dt:.3f}", "native beam-tok/s": nat_rate})
                print(f"{s.workload} width {s.width}: native {dt:.2f} s", flush=True)
                results.append(f"{key}_native={nat_rate:.0f}")
            if not a.no_loop:
                n = loop_requests(s, a.loop_max_calls)
                top_n = loop_top_n(s, cap)
                if s.trie is None and top_n < s.width + 1:
                    print(f"loop: top {top_n} ids per beam (the engine's bound), not {s.width + 1}: approximate",
                          flush=True)
                dt_l, loop_best, stats = await run_loop(e, s, prompts[:n], warm[:1], eos, top_n)
                loop_rate = n * work / dt_l
                row.update({"loop requests": n, "loop s": f"{dt_l:.3f}", "loop beam-tok/s": loop_rate,
                            "calls/s": stats["calls"] / dt_l})
                print(f"{s.workload} width {s.width}: loop {n} requests, {stats['calls']} calls, {dt_l:.2f} s",
                      flush=True)
                results.append(f"{key}_loop={loop_rate:.0f}")
                if native:
                    ratio = nat_rate / loop_rate
                    row["native/loop"] = f"{ratio:.2f}x"
                    row["agree"] = f"{sum(x == y for x, y in zip(loop_best, nat_best)) / n:.0%}"
                    results.append(f"{key}_ratio={ratio:.2f}")
            rows.append(row)
    print(f"on {machine()}, model {'tiny Llama (CPU, dummy)' if a.cpu_small else 'Qwen3-0.6B arch (dummy bf16)'}")
    print(table(rows))
    print("RESULT name=W6 " + " ".join(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="8,64,200", help="comma list of beam widths")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--trie-width", type=int, default=200)
    ap.add_argument("--trie-sequences", type=int, default=100_000)
    ap.add_argument("--no-trie", action="store_true", help="skip the seed's trie shape")
    ap.add_argument("--no-loop", action="store_true", help="skip the user-side loop")
    ap.add_argument("--no-native", action="store_true", help="skip native beam search")
    ap.add_argument("--loop-max-calls", type=int, default=200_000,
                    help="the loop runs as many requests as fit this many generate requests (at least one)")
    ap.add_argument("--max-running", type=int, default=1024, help="max_running_requests (request rows)")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV slots (default: sized from memory)")
    ap.add_argument("--cpu-small", action="store_true",
                    help="8 requests x 32 in, 8 out, widths 4 and 8, trie width 8 over 2,000 sequences, on CPU")
    a = ap.parse_args()
    if a.cpu_small:
        a.widths, a.requests, a.input_len, a.output_len = "4,8", 8, 32, 8
        a.trie_width, a.trie_sequences, a.max_running = 8, 2000, 128
    a.widths = [int(w) for w in a.widths.split(",") if w]
    asyncio.run(bench(a))


if __name__ == "__main__":
    main()
