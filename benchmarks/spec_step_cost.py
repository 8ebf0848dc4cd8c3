"""Where a decode step's time goes with and without speculative decoding: an engine in
this process serves C concurrent requests whose prompts repeat a passage (so n-gram
proposals are taken), and the scheduler's counters split the time per decode step into
the host's building (a draft model's forwards included), waiting on the device and
processing, with the GPU's busy and idle time (from CUDA events) beside them. With
--draft, a draft model (STANDALONE) runs too: given the target's own directory and
dummy weights, its proposals are the target's, so every one is taken and the step's
cost is the mechanism's alone. With --load-format null (a directory from
sgl.testing.engines.null_model_dir) the prompts hold the null model's own continuations, so
every proposal is taken and the step costs the host alone; a directory written with a
DeviceTime adds a modelled device's time to each forward, which shows on a CPU how the
loop schedules speculative steps beside a GPU. The overlap loop runs on a CPU too.

By default the C requests start together. `--closed-loop N` sends N requests through C
workers instead, each sending its next when its last ends, output lengths spread over
[new_tokens / 2, new_tokens]: requests then join while others run, out of step with them,
as an online server's do (the time is then the whole run's, first send to last end).

    python -m benchmarks.spec_step_cost MODEL [--concurrency 1,8] [--load-format dummy] [--draft DIR]
        [--closed-loop N] [--algorithms plain,NGRAM,STANDALONE]"""

from __future__ import annotations

import argparse
import asyncio
import time

import sgl
from sgl.runtime.child import gpu_scheduler_process
from sgl.testing.engines import null_continuation

KEYS = ("build_s", "wait_s", "process_s", "gpu_decode_busy_s", "gpu_decode_idle_s", "gpu_busy_s", "gpu_idle_s")
COUNTS = ("spec_draft_graph_forwards", "spec_regroups")


def prompt_ids(i: int, null_vocab: int | None) -> list[int]:
    """A prompt that repeats a passage; for the null model (its vocabulary given), one that
    holds the null model's own continuation of its last token, so every proposal is taken."""
    if null_vocab is not None:
        x = (1000 + 37 * i) % null_vocab
        return [x, *null_continuation(x, 600, null_vocab), x]
    passage = [1000 + (7 * j + i) % 500 for j in range(120)]
    return [50 + i] + passage * 3


async def closed_loop(e: sgl.AsyncEngine, concurrency: int, requests: int, null: int | None,
                      new_tokens: int) -> list[dict]:
    """`requests` requests through `concurrency` workers, output lengths spread over
    [new_tokens / 2, new_tokens]: each worker sends its next when its last ends."""
    todo = iter(range(requests))
    outs: list[dict] = []

    async def worker() -> None:
        for i in todo:
            n = new_tokens // 2 + (i * 37) % (new_tokens - new_tokens // 2 + 1)
            sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
            outs.append(await e.generate(input_ids=prompt_ids(i, null), sampling_params=sp))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outs


async def run(model: str, concurrency: int, spec: dict[str, object], load_format: str, new_tokens: int,
              requests: int | None) -> str:
    async with sgl.AsyncEngine(model, transport="inproc", load_format=load_format, skip_tokenizer_init=True,
                               random_seed=0, disable_overlap_schedule=False, **spec) as e:
        null = (await e.get_server_info())["vocab_size"] if load_format == "null" else None
        sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        await e.generate(input_ids=prompt_ids(99, null), sampling_params=sp)  # warm-up
        before = await e.get_server_info()
        t0 = time.perf_counter()
        if requests is None:
            outs = await asyncio.gather(*(e.generate(input_ids=prompt_ids(i, null), sampling_params=sp)
                                          for i in range(concurrency)))
        else:
            outs = await closed_loop(e, concurrency, requests, null, new_tokens)
        wall = time.perf_counter() - t0
        info = await e.get_server_info()
    steps = info["decode_steps"] - before["decode_steps"]
    tokens = sum(len(o["output_ids"]) for o in outs)
    per = {k: 1e3 * (info.get(k, 0.0) - before.get(k, 0.0)) / max(steps, 1) for k in KEYS}
    name = spec.get("speculative_algorithm", "plain")
    return (f"c={concurrency} {name}: {wall:.2f} s, {tokens} tokens, {steps} steps, "
            f"{1e3 * wall / max(steps, 1):.2f} ms/step, accept {info.get('spec_accept_length')}; per step ms: "
            + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in per.items())
            + "".join(f", {k} {info[k] - before[k]}" for k in COUNTS if k in info))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=5)
    ap.add_argument("--draft", help="a draft model's directory: STANDALONE runs too")
    ap.add_argument("--closed-loop", type=int, default=None, metavar="N",
                    help="N requests through the C workers, joining out of step (see above)")
    ap.add_argument("--algorithms", default="plain,NGRAM,STANDALONE",
                    help="which to run (STANDALONE only with --draft), e.g. NGRAM alone under a profiler")
    a = ap.parse_args()
    gpu_scheduler_process()  # the settings of a served engine's scheduler process
    k = a.draft_tokens
    chosen = a.algorithms.split(",")
    if unknown := set(chosen) - {"plain", "NGRAM", "STANDALONE"}:
        ap.error(f"--algorithms: unknown {sorted(unknown)}; choose among plain, NGRAM, STANDALONE")
    specs: list[dict[str, object]] = [{}, {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": k}]
    if a.draft:
        specs.append({"speculative_algorithm": "STANDALONE", "speculative_num_draft_tokens": k,
                      "speculative_draft_model_path": a.draft})
    specs = [s for s in specs if s.get("speculative_algorithm", "plain") in chosen]
    for c in (int(x) for x in a.concurrency.split(",")):
        for spec in specs:
            print(asyncio.run(run(a.model, c, spec, a.load_format, a.new_tokens, a.closed_loop)), flush=True)


if __name__ == "__main__":
    main()
