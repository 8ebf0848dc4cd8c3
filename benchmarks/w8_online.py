"""W8 (BENCHMARKS.md): online serving as a user feels it, against any OpenAI-compatible
server (`sgl serve`, `vllm serve`), streaming over HTTP.

Workloads: `w2`, W2's lengths (input and output uniform in [100, 1024], seed 0) sent as
token-id prompts to /v1/completions at temperature 0.6; `chat`, a shared ~1,000-token
system prompt plus a short unique user message to /v1/chat/completions, 128-256 output
tokens. Both set `ignore_eos` on every request, so each makes exactly the tokens asked.
`edit` is copy-heavy, the shape that speculative decoding by n-gram lookup speeds up: a
chat request to correct the spelling of a passage of this repository's docs/*.md (80-300
words of prose, so the prompts follow the checkout's docs; two adjacent letters swapped in
~3% of its words) and reply with the corrected text only; max_tokens is 1.3 times the
passage's tokens (estimated at 4 characters each), at most 512, and the model stops where
it is done (no `ignore_eos`, so output lengths are the model's). Each point (a Poisson
request rate, `inf` = all at once, or a fixed concurrency: N workers, each sending its next
request when its last one ends) sends `--requests` requests, seeded, with prompts of their
own so that no point hits the prefix cache with another's (the chat system prompt is shared
by all, as a deployment's would be).

Per request: TTFT (send to the first chunk carrying a token), the gaps between chunks
carrying tokens, end-to-end latency, output tokens. Tokens per chunk come from
`stream_options: {"include_usage": true, "continuous_usage_stats": true}` (cumulative
`usage.completion_tokens` on every chunk; sgl and vLLM both send it); a server that sends
none is counted one token per chunk with choices, and the point says `tokens_from: chunks`.
Per point, p50/p90/p99 of: TTFT; `itl`, every gap between token-carrying chunks of every
request (a chunk carrying k tokens is one gap: what a reader sees); `tpot`, each request's
mean inter-token time, (e2e - ttft) / (tokens - 1), over requests; e2e. Also the most requests
open at once (`max_in_flight`), the achieved
request rate and output tokens/s (first send to last end), each request's first and last gap
apart (where in a stream its slow gaps fall), failures (a failed request is
recorded, never fatal) and the client's own CPU time per chunk. With `--launch` (Linux), the
server's too: each of its processes' CPU seconds per wall second over the point and per
token (`server_cpu`, busiest first), which shows the process that caps a saturated server
(an HTTP front end's loop, a scheduler's, a detokenizer's). From a server with sgl's
/get_server_info, its counters over each point (`engine`): the scheduler's steps, its host
time per step (build, wait for results, process), the GPU's busy share, and speculation's
requests' steps with guesses and without, and the guesses kept.

The client is httpx streaming the server-sent events by hand: the openai client goes
through the same httpx transport and then builds a pydantic object per chunk, which at
thousands of chunks per second is client time measured as latency. `--procs P` splits
each point's requests over P client processes (each with its own event loop, timestamps
on the shared monotonic clock) for when one process's CPU would be the bottleneck: each
point reports `client_cpu_load`, its CPU seconds per wall second.

    python -m benchmarks.w8_online --url http://127.0.0.1:30000 [--workloads w2,chat,edit]
        [--rates 2,4,8,16,32,inf] [--concurrency 1,4,16,64] [--requests 256] [--json F]
        [--saturation-requests N]   # the `inf` point's requests: enough to fill the engine
        # `--rates none` (or `--concurrency none`) leaves that sweep out
        [--launch 'sgl serve DIR --port 30000 ...']   # start the server, wait for it, stop it after
        [--plots DIR] [--label sgl]
    python -m benchmarks.w8_online --plot sgl.json vllm.json --labels sgl,vllm --out DIR
    python -m benchmarks.w8_online --compare sgl.json vllm.json [--target 1.15]
        # markdown tables; exit 0 where sgl's p50/p99 TTFT and ITL are no worse at every
        # point both sustain and its saturation throughput is at least --target times vLLM's
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import multiprocessing
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import table, w2_requests

STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
WORDS = ("the system shall answer every question with care and cite the relevant section of the policy "
         "manual when a customer asks about refunds shipping warranty returns invoices accounts passwords "
         "orders delivery dates product sizes colours materials prices discounts coupons gift cards stores "
         "opening hours holidays privacy data security payment methods currency taxes exchange repair").split()
DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"
EDIT_WORDS = (80, 300)  # a passage's length in words, at least and at most
EDIT_TYPO_RATE = 0.03  # the share of a passage's words given a typo
# max_tokens: the passage's tokens, estimated at 4 characters each (0.9-1.3x the real count
# with SmolLM2's tokenizer, whose docs passages run 1.3-2.6 tokens a word), times 1.3.
EDIT_CHARS_PER_TOKEN = 4
EDIT_OUTPUT_ROOM = 1.3
EDIT_MAX_TOKENS = 512
EDIT_INSTRUCTION = "Rewrite the text below with its spelling mistakes corrected. Reply with the corrected text only."


@dataclass
class Request:
    """One request of a point: the route, its JSON body less the model, and the tokens it asks
    for; `exact`: it ignores EOS, so anything but `max_tokens` tokens is a failure."""

    route: str
    body: dict[str, Any]
    max_tokens: int
    exact: bool = True


@dataclass
class Record:
    """What one request measured; times in seconds on the monotonic clock."""

    index: int
    sent: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    asked: int = 0
    chunks: int = 0
    gaps: list[float] = field(default_factory=list)
    from_usage: bool = True
    error: str | None = None


# ---------------------------------------------------------------- workloads

def system_prompt(words: int = 750, seed: int = 0) -> str:
    """About 1,000 tokens of English-like text (750 words of a small vocabulary)."""
    rng = random.Random(seed)
    return "You are a support assistant. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def make_requests(workload: str, n: int, point: int, seed: int, temperature: float,
                  output_cap: int | None = None) -> list[Request]:
    """`n` requests of `workload` for point number `point`: W2's lengths always, fresh ids per
    point (w2), fresh messages per point (chat, edit); output lengths capped at `output_cap` if given."""
    cap = output_cap or 1 << 30
    if workload == "w2":
        prompts, outs = w2_requests(n, seed)
        outs = [min(o, cap) for o in outs]
        rng = random.Random(seed * 1_000_003 + point)
        reqs = []
        for p, o in zip(prompts, outs):
            ids = [rng.randrange(10000) for _ in p] if point else p
            reqs.append(Request("/v1/completions", {"prompt": ids, "max_tokens": o, "temperature": temperature,
                                                    "ignore_eos": True}, o))
        return reqs
    if workload == "edit":
        return edit_requests(n, point, seed, temperature, cap)
    if workload == "chat":
        rng = random.Random(seed * 1_000_003 + point)
        sys_msg = system_prompt(seed=seed)
        reqs = []
        for i in range(n):
            user = f"Ticket {point}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))) + "?"
            o = min(rng.randint(128, 256), cap)
            reqs.append(Request("/v1/chat/completions", {
                "messages": [{"role": "system", "content": sys_msg}, {"role": "user", "content": user}],
                "max_tokens": o, "temperature": temperature, "ignore_eos": True}, o))
        return reqs
    raise ValueError(f"unknown workload {workload!r} (w2, chat, edit)")


_LIST_ITEM = re.compile(r"([-*+]|\d+[.)])\s")
_TYPO_WORD = re.compile(r"([A-Za-z]{4,})([,.;:!?]?)")


def prose_runs(markdown: str) -> list[list[str]]:
    """The runs of consecutive prose paragraphs of a Markdown text, each paragraph on one line;
    a code block, table, heading, list or quote ends a run."""
    blocks: list[list[str] | None] = []  # paragraphs as their lines; None where a code block stood
    lines: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            blocks += [lines, None]
            lines = []
            fenced = not fenced
        elif not fenced and line.strip():
            lines.append(line)
        elif not fenced:
            blocks.append(lines)
            lines = []
    blocks.append(lines)
    runs: list[list[str]] = [[]]
    for block in blocks:
        if block == []:
            continue
        if block is not None and is_prose(block):
            runs[-1].append(" ".join(line.strip() for line in block))
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


def is_prose(paragraph: list[str]) -> bool:
    """Whether a Markdown paragraph (its lines) is text: not a heading, list, quote, HTML,
    indented code or table."""
    first = paragraph[0]
    return not (first.startswith(("#", ">", "<", "    ", "\t")) or _LIST_ITEM.match(first)
                or any(line.lstrip().startswith("|") for line in paragraph))


@lru_cache(maxsize=4)
def doc_passages(folder: str = str(DOCS_DIR)) -> tuple[str, ...]:
    """Prose passages of EDIT_WORDS words from `folder`'s *.md files, in file order: a prose
    paragraph joined with those right after it until the passage has enough words."""
    lo, hi = EDIT_WORDS
    passages: list[str] = []
    for path in sorted(Path(folder).glob("*.md")):
        for run in prose_runs(path.read_text(encoding="utf-8")):
            taken: list[str] = []
            for para in run:
                if taken and len(" ".join(taken + [para]).split()) > hi:
                    taken = []  # too short alone, too long with the next paragraph: left out
                taken.append(para)
                words = len(" ".join(taken).split())
                if words > hi:
                    taken = []
                elif words >= lo:
                    passages.append("\n\n".join(taken))
                    taken = []
    return tuple(passages)


def with_typos(text: str, rng: random.Random, rate: float = EDIT_TYPO_RATE) -> str:
    """`text` with two adjacent letters swapped, never the first or the last, in ~`rate` of its
    words (at least one): words of 4+ letters and nothing else but a trailing punctuation mark."""
    words = text.split(" ")
    candidates = []
    for i, word in enumerate(words):
        m = _TYPO_WORD.fullmatch(word)
        if m and any(a != b for a, b in zip(m[1][1:-2], m[1][2:-1])):
            candidates.append(i)
    if not candidates:
        return text
    for i in sorted(rng.sample(candidates, min(len(candidates), max(1, round(rate * len(words)))))):
        m = _TYPO_WORD.fullmatch(words[i])
        assert m is not None
        letters = m[1]
        k = rng.choice([k for k in range(1, len(letters) - 2) if letters[k] != letters[k + 1]])
        words[i] = letters[:k] + letters[k + 1] + letters[k] + letters[k + 2:] + m[2]
    return " ".join(words)


def edit_requests(n: int, point: int, seed: int, temperature: float, cap: int) -> list[Request]:
    """The edit workload: passages in a seeded order of their own per point, fresh typos
    per request, and a system message naming the request so that requests share no prefix."""
    passages = doc_passages()
    if not passages:
        raise ValueError(f"no prose passages of {EDIT_WORDS[0]}-{EDIT_WORDS[1]} words in {DOCS_DIR}/*.md")
    rng = random.Random(seed * 1_000_003 + point)
    order = list(range(len(passages)))
    rng.shuffle(order)
    reqs = []
    for i in range(n):
        text = passages[order[i % len(order)]]
        o = min(math.ceil(len(text) / EDIT_CHARS_PER_TOKEN * EDIT_OUTPUT_ROOM), EDIT_MAX_TOKENS, cap)
        messages = [{"role": "system", "content": f"You are a careful copy editor (job {point}-{i})."},
                    {"role": "user", "content": f"{EDIT_INSTRUCTION}\n\n{with_typos(text, rng)}"}]
        reqs.append(Request("/v1/chat/completions", {"messages": messages, "max_tokens": o,
                                                     "temperature": temperature}, o, exact=False))
    return reqs


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the point's start) of a Poisson process at `rate` req/s; inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------- the client

async def stream_one(client: httpx.AsyncClient, model: str, req: Request, rec: Record) -> None:
    """Send one streaming request and fill `rec`; any failure goes to `rec.error`."""
    body = {**req.body, "model": model, "stream": True, "stream_options": STREAM_OPTIONS}
    rec.asked = req.max_tokens
    last = 0.0
    usage_total: int | None = None
    rec.sent = time.perf_counter()
    try:
        async with client.stream("POST", req.route, json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            buf = b""
            async for data in r.aiter_raw():
                now = time.perf_counter()
                buf += data
                # Events end with a blank line; a read may hold several or part of one.
                while (end := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:end], buf[end + 2:]
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        rec.error = f"stream error: {str(chunk['error'])[:200]}"
                        return
                    usage = chunk.get("usage")
                    choices = chunk.get("choices")
                    if usage is not None:
                        new = usage["completion_tokens"] - (usage_total or 0)
                        usage_total = usage["completion_tokens"]
                    elif choices:
                        rec.from_usage = False
                        delta = choices[0].get("delta")
                        new = 0 if delta is not None and not delta.get("content") and delta.get("role") else 1
                    else:
                        new = 0
                    if new <= 0:
                        continue
                    rec.chunks += 1
                    rec.tokens += new
                    if rec.ttft is None:
                        rec.ttft = now - rec.sent
                    else:
                        rec.gaps.append(now - last)
                    last = now
        rec.e2e = last - rec.sent if rec.ttft is not None else time.perf_counter() - rec.sent
        if usage_total is not None:
            rec.tokens = usage_total
        if rec.tokens != rec.asked and (req.exact or not 0 < rec.tokens < rec.asked):
            rec.error = f"{rec.tokens} tokens of {rec.asked} asked"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not the end of the run
        rec.error = f"{type(e).__name__}: {e}"[:300]


def http_client(url: str, api_key: str | None, timeout: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(timeout, connect=30),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_share(url: str, api_key: str | None, model: str, reqs: list[tuple[int, Request]], t0: float,
                    sends: list[float] | None, workers: int, timeout: float) -> list[Record]:
    """Run this process's share of a point: at their send times (`sends`, s after `t0`), or
    through `workers` workers each sending its next request when its last ends."""
    recs = [Record(i) for i, _ in reqs]
    async with http_client(url, api_key, timeout) as client:
        if sends is not None:
            async def at(k: int) -> None:
                await asyncio.sleep(max(0.0, t0 + sends[k] - time.perf_counter()))
                await stream_one(client, model, reqs[k][1], recs[k])

            await asyncio.gather(*(at(k) for k in range(len(reqs))))
        else:
            todo = iter(range(len(reqs)))

            async def worker() -> None:
                for k in todo:
                    await stream_one(client, model, reqs[k][1], recs[k])

            await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
            await asyncio.gather(*(worker() for _ in range(workers)))
    return recs


def _share_in_process(args: tuple[Any, ...]) -> tuple[list[Record], float]:
    cpu = time.process_time()
    recs = asyncio.run(run_share(*args))
    return recs, time.process_time() - cpu


def split_point(n: int, procs: int, workers: int | None) -> tuple[list[list[int]], list[int]]:
    """A point's request indices over its client processes, and each process's workers
    (`workers`: the point's concurrency; None for a rate point, 1 each, unused). A
    concurrency point uses at most `workers` processes, so that their workers add up to
    exactly the concurrency asked."""
    procs = max(1, min(procs, n, workers or procs))
    share_workers = [1] * procs if workers is None else [workers // procs + (p < workers % procs) for p in range(procs)]
    return [list(range(p, n, procs)) for p in range(procs)], share_workers


class ServerCpu:
    """CPU time of a launched server's processes (its session: the server and every child
    it started), read from /proc; nothing where /proc is missing. Each `take` returns the
    CPU seconds each process used since the last one, keyed by pid, with its command line."""

    def __init__(self, session: int) -> None:
        self.session = session
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last: dict[int, float] = {}
        self.take()

    def _now(self) -> dict[int, tuple[float, str]]:
        out: dict[int, tuple[float, str]] = {}
        try:
            pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return out
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read().decode()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").rstrip("\0").split("\0")
                cmd = " ".join([os.path.basename(argv[0]), *argv[1:]])  # the interpreter's path says little
            except OSError:
                continue  # gone meanwhile
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
            if int(fields[3]) == self.session:
                out[pid] = ((int(fields[11]) + int(fields[12])) / self.tick, cmd)
        return out

    def take(self) -> dict[int, tuple[float, str]]:
        now = self._now()
        used = {pid: (cpu - self.last.get(pid, 0.0), cmd) for pid, (cpu, cmd) in now.items()}
        self.last = {pid: cpu for pid, (cpu, _) in now.items()}
        return used


class EngineCounters:
    """The server's own counters over a point, where it has them: sgl's GET /get_server_info
    (the scheduler's steps, its host time per turn split into build, wait and process, the
    GPU's busy and idle time, speculation's steps and tokens). `take` returns what each
    numeric counter grew by since the last call; {} from a server without that route."""

    KEYS = ("decode_steps", "owed_steps", "mixed_steps", "prefill_tokens", "cached_tokens", "build_s", "wait_s",
            "process_s", "mask_wait_s", "gpu_busy_s", "gpu_idle_s", "spec_steps", "spec_plain_steps",
            "spec_proposed_tokens", "spec_accepted_tokens", "spec_regroups")

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url, self.headers = url, ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.last: dict[str, float] | None = None  # the first `take` reads the counters, and returns {}

    def _now(self) -> dict[str, float] | None:
        try:
            r = httpx.get(self.url + "/get_server_info", headers=self.headers, timeout=10)
        except httpx.TransportError:
            return None
        if r.status_code != 200:
            return None
        info = r.json()
        return {k: float(info[k]) for k in self.KEYS if isinstance(info.get(k), (int, float))}

    def take(self) -> dict[str, float]:
        now, last = self._now(), self.last
        self.last = now
        if not now or not last:
            return {}
        return {k: round(v - last.get(k, 0.0), 6) for k, v in now.items()}


def engine_line(c: dict[str, float]) -> str:
    """A point's engine counters in a line: host ms per scheduler step (build, wait, process) and
    the GPU's busy share; with speculation, requests' steps with guesses and without, the
    guesses kept per step with guesses, and the steps held back so that requests guess together."""
    steps = c.get("decode_steps", 0.0)
    if not steps:
        return ""
    per = " / ".join(f"{c.get(k, 0.0) * 1e3 / steps:.2f}" for k in ("build_s", "wait_s", "process_s"))
    busy, idle = c.get("gpu_busy_s", 0.0), c.get("gpu_idle_s", 0.0)
    out = f"{steps:.0f} decode steps"
    if c.get("mixed_steps"):
        out += f" ({c['mixed_steps']:.0f} in prefills' forwards)"
    if c.get("owed_steps"):
        out += f" ({c['owed_steps']:.0f} ahead of a waiting prompt)"
    out += f"; host ms per step build / wait / process {per}"
    if busy + idle:
        out += f"; GPU busy {busy / (busy + idle):.0%}"
    if c.get("spec_steps"):
        out += (f"; requests' steps with guesses {c['spec_steps']:.0f}, without {c.get('spec_plain_steps', 0.0):.0f}, "
                f"guesses kept per step with guesses {c.get('spec_accepted_tokens', 0.0) / c['spec_steps']:.2f}, "
                f"steps held back to regroup {c.get('spec_regroups', 0.0):.0f}")
    return out


def server_cpu(used: dict[int, tuple[float, str]], wall: float, tokens: int) -> list[dict[str, Any]]:
    """A point's server processes by CPU load (CPU seconds per wall second), busiest first;
    those below 1% are left out."""
    rows = [{"pid": pid, "cmd": cmd[:200], "load": round(cpu / wall, 3),
             "us_per_token": round(cpu / max(1, tokens) * 1e6, 1)}
            for pid, (cpu, cmd) in used.items() if wall > 0 and cpu / wall >= 0.01]
    return sorted(rows, key=lambda r: -r["load"])


def run_point(url: str, api_key: str | None, model: str, reqs: list[Request], sends: list[float] | None,
              workers: int, procs: int, timeout: float) -> tuple[list[Record], float, float]:
    """All of one point's requests, over `procs` client processes; returns the records (in
    request order), the wall time from first send to last end, and the clients' CPU seconds."""
    shares, share_workers = split_point(len(reqs), procs, None if sends is not None else workers)
    procs = len(shares)
    shares_r = [[(i, reqs[i]) for i in s] for s in shares]
    share_sends = [None if sends is None else [sends[i] for i in s] for s in shares]
    if procs == 1:
        t0 = time.perf_counter()
        results = [_share_in_process((url, api_key, model, shares_r[0], t0, share_sends[0], workers, timeout))]
    else:
        # Fork: the children start at once; t0 leaves them time to open their loops.
        with multiprocessing.get_context("fork").Pool(procs) as pool:
            t0 = time.perf_counter() + 0.2
            results = pool.map(_share_in_process, [(url, api_key, model, s, t0, ss, w, timeout)
                                                   for s, ss, w in zip(shares_r, share_sends, share_workers)])
    recs = sorted((r for rs, _ in results for r in rs), key=lambda r: r.index)
    ended = [r.sent + r.e2e for r in recs if r.e2e is not None]
    wall = (max(ended) if ended else time.perf_counter()) - min(r.sent for r in recs)
    return recs, wall, sum(c for _, c in results)


# ---------------------------------------------------------------- statistics

def percentiles(xs: list[float], scale: float = 1e3) -> dict[str, float | None]:
    """p50/p90/p99 and mean of `xs` times `scale` (ms by default), linear between ranks."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return (s[lo] + (s[hi] - s[lo]) * (k - lo)) * scale

    return {"p50": round(q(0.5), 3), "p90": round(q(0.9), 3), "p99": round(q(0.99), 3),
            "mean": round(sum(s) / len(s) * scale, 3)}


def max_in_flight(recs: list[Record]) -> int:
    """The most requests open at once (sent, last chunk not yet in): a concurrency point's
    check that it ran at the concurrency it names."""
    events = sorted([(r.sent, 1) for r in recs if r.e2e is not None]
                    + [(r.sent + r.e2e, -1) for r in recs if r.e2e is not None], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


LONG_GAP_S = 0.010  # a gap between chunks this long counts as a stall (decode steps here take 2-3 ms)


def chunk_times(r: Record) -> list[float]:
    """When each of a request's token-carrying chunks came (it has a first token)."""
    assert r.ttft is not None
    return list(accumulate(r.gaps, initial=r.sent + r.ttft))


def shared_stalls(recs: list[Record]) -> tuple[int, float | None]:
    """The gaps of LONG_GAP_S or more, and the mean share of the other streams open across
    such a gap that got no chunk inside it either: near 1, something held every stream at
    once (a long forward, a blocked loop); near 0, each stall was its own stream's. Chunk
    times of all client processes compare: perf_counter is the system's monotonic clock.
    The chunks of one step reach the streams a little apart (the server writes them one by
    one, each client reads its own), so another stream counts as held when it got no chunk
    in the middle half of the gap: its own gap around the same hold starts or ends a
    moment off."""
    streams = [chunk_times(r) for r in recs if r.error is None and r.ttft is not None]
    stalls = [(i, a, b) for i, t in enumerate(streams) for a, b in zip(t, t[1:]) if b - a >= LONG_GAP_S]
    shares = []
    for i, a, b in stalls:
        others = [t for j, t in enumerate(streams) if j != i and t[0] < a and t[-1] > b]
        if others:
            m = (b - a) / 4
            quiet = sum(bisect.bisect_left(t, b - m) == bisect.bisect_right(t, a + m) for t in others)
            shares.append(quiet / len(others))
    return len(stalls), round(sum(shares) / len(shares), 3) if shares else None


def stalls_at_prompts(recs: list[Record]) -> tuple[float | None, float | None]:
    """Of the gaps of LONG_GAP_S or more, the share that overlap another request's wait for
    its first token (sent, its prompt not yet answered: queued, tokenized or in its prefill),
    and the share a window of their mean length placed anywhere in the run would overlap
    such a wait (chance). Well above chance, the stalls come with new prompts (a prefill's
    forward holding the streams, a prompt's tokenizing holding a process); near it, with
    something else. Client-side only, so it reads any server alike."""
    ok = [r for r in recs if r.ttft is not None]
    waits = sorted((r.sent, r.sent + r.ttft, r.index) for r in ok)  # (sent, first token, request)
    starts = [w[0] for w in waits]
    # The stalls shared_stalls counts, each with its request.
    long = [(a, b, r.index) for r in ok for t in [chunk_times(r)] for a, b in zip(t, t[1:]) if b - a >= LONG_GAP_S]
    if not long:
        return None, None
    # Another's wait overlaps (a, b) when it starts before b and ends after a.
    hits = sum(any(first > a and j != i for _, first, j in waits[:bisect.bisect_left(starts, b)])
               for a, b, i in long)
    length = sum(b - a for a, b, _ in long) / len(long)
    span_a, span_b = starts[0], max(r.sent + (r.e2e or r.ttft) for r in ok) - length
    # A window of that length starting at s meets the wait (a, b) when s is in (a - length, b):
    # the measure of the union of those over the span of possible starts.
    covered, reach = 0.0, span_a
    for a, b, _ in waits:
        lo, hi = max(a - length, reach), min(b, span_b)
        if hi > lo:
            covered += hi - lo
        reach = max(reach, hi)
    chance = covered / (span_b - span_a) if span_b > span_a else None
    return round(hits / len(long), 3), None if chance is None else round(chance, 3)


def summarize(workload: str, mode: str, value: float, recs: list[Record], wall: float, cpu: float) -> dict[str, Any]:
    ok = [r for r in recs if r.error is None]
    errors = sorted({r.error for r in recs if r.error is not None})
    chunks = sum(r.chunks for r in recs)
    tokens = sum(r.tokens for r in ok)
    return {
        "workload": workload, "mode": mode, "value": "inf" if math.isinf(value) else value,
        "requests": len(recs), "ok": len(ok), "failed": len(recs) - len(ok), "errors": errors[:5],
        "duration_s": round(wall, 3),
        "req_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "out_tok_s": round(tokens / wall, 1) if wall > 0 else None, "out_tokens": tokens,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([g for r in ok for g in r.gaps]),
        "tpot_ms": percentiles([(r.e2e - r.ttft) / (r.tokens - 1) for r in ok
                                if r.e2e is not None and r.ttft is not None and r.tokens > 1]),
        "e2e_ms": percentiles([r.e2e for r in ok if r.e2e is not None]),
        # Where in a stream the slow gaps fall: a request's first gap (its first decode step
        # after the prefill) and its last, apart from all gaps (itl).
        "max_in_flight": max_in_flight(recs),
        "first_gap_ms": percentiles([r.gaps[0] for r in ok if r.gaps]),
        "last_gap_ms": percentiles([r.gaps[-1] for r in ok if r.gaps]),
        # How many gaps were stalls (LONG_GAP_S or more) and how far they were shared.
        **dict(zip(("long_gaps", "long_gaps_shared"), shared_stalls(ok))),
        # How far they came with new prompts, against chance.
        **dict(zip(("long_gaps_at_prompts", "long_gaps_at_prompts_chance"), stalls_at_prompts(ok))),
        "tokens_per_chunk": round(tokens / max(1, sum(r.chunks for r in ok)), 3),
        "tokens_from": "usage" if all(r.from_usage for r in recs) else "chunks",
        "client_cpu_us_per_chunk": round(cpu / max(1, chunks) * 1e6, 1),
        "client_cpu_load": round(cpu / wall, 3) if wall > 0 else None,
    }


def row(p: dict[str, Any]) -> dict[str, object]:
    def ms(k: str, q: str) -> str:
        v = p[k][q]
        return "-" if v is None else f"{v:,.1f}"

    point = f"{'rate' if p['mode'] == 'rate' else 'conc'} {float(p['value']):g}"
    return {"point": point, "ok": f"{p['ok']}/{p['requests']}", "req/s": p["req_s"] or 0.0,
            "out tok/s": p["out_tok_s"] or 0.0,
            "TTFT p50/p90/p99 ms": "/".join(ms("ttft_ms", q) for q in ("p50", "p90", "p99")),
            "ITL p50/p90/p99 ms": "/".join(ms("itl_ms", q) for q in ("p50", "p90", "p99")),
            "TPOT p50/p99 ms": "/".join(ms("tpot_ms", q) for q in ("p50", "p99")),
            "E2E p50/p99 s": "/".join("-" if p["e2e_ms"][q] is None else f"{p['e2e_ms'][q] / 1e3:.2f}"
                                     for q in ("p50", "p99")),
            "tok/chunk": p["tokens_per_chunk"],
            "client cpu": f"{p['client_cpu_load'] or 0:.0%} ({p['client_cpu_us_per_chunk']:.0f} us/chunk)",
            **({"server cpu (busiest first)": " ".join(f"{r['load']:.0%}" for r in p["server_cpu"][:4])}
               if p.get("server_cpu") else {})}


def result_line(label: str, points: list[dict[str, Any]]) -> str:
    """`RESULT w8 ...`: failures, and per workload its saturation throughput (the median of its
    `inf` points), its best throughput, p50/p99 TTFT and ITL and p50 TPOT at concurrency 1."""
    parts = [f"label={label}", f"failed={sum(p['failed'] for p in points)}"]
    for w in dict.fromkeys(p["workload"] for p in points):
        mine = [p for p in points if p["workload"] == w and p["ok"]]
        if sat := [p["out_tok_s"] or 0 for p in mine if p["mode"] == "rate" and math.isinf(float(p["value"]))]:
            parts.append(f"{w}_sat_tok_s={statistics.median(sat):.0f}")
        if mine:
            parts.append(f"{w}_max_tok_s={max(p['out_tok_s'] or 0 for p in mine):.0f}")
        one = [p for p in mine if p["mode"] == "concurrency" and float(p["value"]) == 1]
        for p in one[:1]:
            for k in ("ttft_ms", "itl_ms"):
                parts += [f"{w}_c1_{k[:-3]}_p50_ms={p[k]['p50']}", f"{w}_c1_{k[:-3]}_p99_ms={p[k]['p99']}"]
            parts.append(f"{w}_c1_tpot_p50_ms={p['tpot_ms']['p50']}")
    return "RESULT w8 " + " ".join(parts)


# ---------------------------------------------------------------- two engines compared

LATENCIES = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"))


def merged_points(points: list[dict[str, Any]], workload: str) -> dict[tuple[str, float], dict[str, Any]]:
    """A workload's points by (mode, value), a repeated point as one: its requests and failures
    summed, its throughput and each latency percentile the median over the repeats (`runs`
    keeps each one's tok/s)."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for p in points:
        if p["workload"] == workload:
            groups.setdefault((p["mode"], float(p["value"])), []).append(p)
    out = {}
    for key, ps in groups.items():
        m: dict[str, Any] = {"requests": sum(p["requests"] for p in ps), "failed": sum(p["failed"] for p in ps),
                             "runs": [p["out_tok_s"] or 0.0 for p in ps],
                             "req_s": statistics.median([p["req_s"] or 0.0 for p in ps])}
        m["out_tok_s"] = statistics.median(m["runs"])
        for k, q in LATENCIES:
            vals = [p[k][q] for p in ps if p[k][q] is not None]
            m.setdefault(k, {})[q] = statistics.median(vals) if vals else None
        out[key] = m
    return out


@dataclass(frozen=True)
class Verdict:
    text: str  # markdown: a table per workload and the findings under it
    met: bool  # every criterion met on every workload both ran


def compare(mine: dict[str, Any], peer: dict[str, Any], target: float) -> Verdict:
    """`mine` against `peer` (two result files of the same sweep), per workload both ran. A
    rate point counts where both engines sustain it: every request ended well and the rate is
    at most the engine's saturation request rate (its `inf` point's, the median of repeats).
    Met when at each of those mine's p50 and p99 TTFT and ITL are no worse than the peer's, and
    mine's saturation throughput (the median of its `inf` points) is at least `target` times
    the peer's. Concurrency points are shown beside them and judged the same way."""
    a, b = mine.get("label", "mine"), peer.get("label", "peer")
    lines: list[str] = []
    met = True
    ran = [w for w in dict.fromkeys(p["workload"] for p in mine["points"])
           if any(p["workload"] == w for p in peer["points"])]
    for w in ran:
        pa, pb = merged_points(mine["points"], w), merged_points(peer["points"], w)
        sat_a, sat_b = pa.get(("rate", math.inf)), pb.get(("rate", math.inf))
        rows: list[dict[str, object]] = []
        worse: list[str] = []
        for key in sorted(set(pa) & set(pb), key=lambda k: (k[0] != "rate", k[1])):
            mode, v = key
            if mode == "rate" and math.isinf(v):
                continue
            x, y = pa[key], pb[key]
            ok = not x["failed"] and not y["failed"]
            if mode == "rate":
                ok = ok and all(s is not None and v <= s["req_s"] for s in (sat_a, sat_b))
            name = f"{mode} {v:g}"
            row: dict[str, object] = {"point": name, "both sustain": "yes" if ok else "no"}
            for k, q in LATENCIES:
                xa, yb = x[k][q], y[k][q]
                bad = ok and (xa is None or (yb is not None and xa > yb))
                row[f"{k[:-3].upper()} {q}"] = f"{_ms(xa)} / {_ms(yb)}" + (" !" if bad else "")
                if bad:
                    worse.append(f"{name} {k[:-3].upper()} {q} ({_ms(xa)} against {_ms(yb)})")
            rows.append(row)
        lines += [f"### {w}: {a} / {b}, ms (! where {a} is worse at a point both sustain)", ""]
        if rows:
            lines += _markdown(rows) + [""]
        lines.append(f"- latency: {a} no worse at every point both sustain" if not worse
                     else f"- latency: {a} worse at " + "; ".join(worse))
        if sat_a is None or sat_b is None:
            lines.append("- saturation: no `inf` point in both files")
            met = False
        else:
            ratio = sat_a["out_tok_s"] / sat_b["out_tok_s"] if sat_b["out_tok_s"] else math.inf
            each = [f"{label} {s['out_tok_s']:,.0f} tok/s"
                    + (f" (median of {', '.join(f'{r:,.0f}' for r in s['runs'])})" if len(s["runs"]) > 1 else "")
                    for label, s in ((a, sat_a), (b, sat_b))]
            lines.append(f"- saturation: {each[0]}, {each[1]}: {ratio:.2f}x (target {target:.2f}x)"
                         + ("" if ratio >= target else ", missed"))
            met = met and ratio >= target
        met = met and not worse
        lines.append("")
    if not ran:
        lines.append(f"{a} and {b} share no workload")
    lines.append(f"**{'met' if ran and met else 'not met'}**: {a} against {b}")
    return Verdict("\n".join(lines), bool(ran) and met)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _markdown(rows: list[dict[str, object]]) -> list[str]:
    cols = list(rows[0])
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows])


# ---------------------------------------------------------------- plots

def plot(results: list[tuple[str, dict[str, Any]]], out: str) -> list[str]:
    """PNGs of p50/p99 TTFT and ITL against request rate, and against concurrency, one line per
    result file; [] (and a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (run --plot on these JSON files where it is)")
        return []
    os.makedirs(out, exist_ok=True)
    written = []
    workloads = dict.fromkeys(p["workload"] for _, d in results for p in d["points"])
    for w in workloads:
        for mode, xlabel in (("rate", "request rate (req/s, Poisson)"), ("concurrency", "concurrent streams")):
            fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
            drew = False
            for label, d in results:
                pts = sorted((p for p in d["points"] if p["workload"] == w and p["mode"] == mode and p["ok"]
                              and not math.isinf(float(p["value"]))), key=lambda p: float(p["value"]))
                if not pts:
                    continue
                drew = True
                xs = [float(p["value"]) for p in pts]
                for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "inter-token latency")):
                    line, = ax.plot(xs, [p[key]["p50"] for p in pts], marker="o", label=f"{label} p50")
                    ax.plot(xs, [p[key]["p99"] for p in pts], marker="x", linestyle="--", color=line.get_color(),
                            label=f"{label} p99")
                    ax.set_title(f"{w}: {name}")
                    ax.set_ylabel("ms")
                axes[2].plot(xs, [p["out_tok_s"] for p in pts], marker="o", label=label)
                axes[2].set_title(f"{w}: output throughput")
                axes[2].set_ylabel("tokens/s")
            if not drew:
                plt.close(fig)
                continue
            for ax in axes:
                ax.set_xscale("log", base=2)
                ax.set_xlabel(xlabel)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
            fig.tight_layout()
            path = os.path.join(out, f"w8_{w}_{mode}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


# ---------------------------------------------------------------- the run

def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, api_key: str | None, timeout: float) -> str:
    """The served model's name, once GET /v1/models answers (within `timeout` s)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            r = httpx.get(url + "/v1/models", headers=headers, timeout=5)
            if r.status_code == 200:
                return str(r.json()["data"][0]["id"])
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout:.0f} s")
        time.sleep(0.5)


def point_values(spec: str) -> list[float]:
    """The numbers of a comma-separated `--rates`/`--concurrency` list; '' or `none`: no points."""
    return [float(v) for v in spec.split(",") if v.strip() and v.strip().lower() != "none"]


def sweep(a: argparse.Namespace, model: str, server: ServerCpu | None = None) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    counters = EngineCounters(a.url, a.api_key)
    plan = [("rate", v) for v in point_values(a.rates)] + [("concurrency", v) for v in point_values(a.concurrency)]
    for w in a.workloads.split(","):
        warm = make_requests(w, a.warmup, 10_000, a.seed, a.temperature, min(a.output_cap or 16, 16))
        recs = run_point(a.url, a.api_key, model, warm, None, len(warm), 1, a.request_timeout)[0] if warm else []
        bad = [r.error for r in recs if r.error]
        print(f"{w}: warm-up {len(recs) - len(bad)}/{len(recs)} ok{' ' + bad[0] if bad else ''}", flush=True)
        if warm and len(bad) == len(recs):
            print(f"{w}: skipped, every warm-up request failed", flush=True)
            continue
        rows = []
        for k, (mode, v) in enumerate(plan):
            n = a.saturation_requests if mode == "rate" and math.isinf(v) and a.saturation_requests else a.requests
            reqs = make_requests(w, n, k + 1, a.seed, a.temperature, a.output_cap)
            sends = arrivals(len(reqs), v, a.seed * 7919 + k) if mode == "rate" else None
            if server is not None:
                server.take()
            counters.take()
            t = time.perf_counter()
            recs, wall, cpu = run_point(a.url, a.api_key, model, reqs, sends, int(v) if sends is None else 0,
                                        a.procs, a.request_timeout)
            p = summarize(w, mode, v, recs, wall, cpu)
            if server is not None:  # over the point's whole time, its clients' start-up included
                p["server_cpu"] = server_cpu(server.take(), time.perf_counter() - t, p["out_tokens"])
            if engine := counters.take():
                p["engine"] = engine
            points.append(p)
            rows.append(row(p))
            print(f"{w} {rows[-1]['point']}: {p['ok']}/{p['requests']} ok, {p['out_tok_s']} tok/s, TTFT p50 "
                  f"{p['ttft_ms']['p50']} ms, ITL p50 {p['itl_ms']['p50']} ms"
                  + (f", errors {p['errors']}" if p["errors"] else ""), flush=True)
            if line := engine_line(p.get("engine", {})):
                print(f"  engine: {line}", flush=True)
            if p["long_gaps"]:
                print(f"  {p['long_gaps']} gaps of {LONG_GAP_S * 1e3:g} ms or more: shared by {p['long_gaps_shared']} "
                      f"of the other streams; {p['long_gaps_at_prompts']} came with a new prompt "
                      f"(chance {p['long_gaps_at_prompts_chance']})", flush=True)
        print(f"--- {w} ({a.label}, {a.url}, model {model}; ms unless said)")
        print(table(rows), flush=True)
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", help="the served model's name (default: the first of /v1/models)")
    ap.add_argument("--api-key")
    ap.add_argument("--label", default="sgl", help="the engine's name in the table, JSON and plots")
    ap.add_argument("--workloads", default="w2,chat", help="comma-separated: w2, chat, edit")
    ap.add_argument("--rates", default="2,4,8,16,32,inf",
                    help="Poisson request rates, req/s (inf: all at once); none: no rate points")
    ap.add_argument("--concurrency", default="1,4,16,64", help="concurrent streams; none: no concurrency points")
    ap.add_argument("--requests", type=int, default=256, help="requests per point")
    ap.add_argument("--saturation-requests", type=int,
                    help="requests of the `inf` rate point (default --requests): enough to keep the engine full")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent before each workload, not measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-cap", type=int, help="cap every output length (quick runs)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--procs", type=int, default=1, help="client processes sharing each point's requests")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the points here")
    ap.add_argument("--plots", help="also write PNG plots of this run into this folder")
    ap.add_argument("--launch", help="a server command to start first (stopped with SIGTERM at the end)")
    ap.add_argument("--launch-timeout", type=float, default=900.0)
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="only plot these result files")
    ap.add_argument("--labels", help="names for the --plot files, comma-separated (default: their labels)")
    ap.add_argument("--out", default=".", help="the --plot mode's output folder")
    ap.add_argument("--compare", nargs=2, metavar=("MINE", "PEER"),
                    help="only compare two result files of one sweep: latency where both sustain a rate, "
                         "saturation against --target; exit 0 when every criterion is met, 1 otherwise")
    ap.add_argument("--target", type=float, default=1.15, help="the --compare mode's saturation throughput ratio")
    a = ap.parse_args(argv)
    if a.compare:
        verdict = compare(*(json.load(open(f)) for f in a.compare), a.target)
        print(verdict.text)
        return 0 if verdict.met else 1
    if a.plot:
        datas = [json.load(open(f)) for f in a.plot]
        labels = a.labels.split(",") if a.labels else [d.get("label", f) for d, f in zip(datas, a.plot)]
        for path in plot(list(zip(labels, datas)), a.out):
            print(path)
        return 0
    proc = None
    if a.launch:
        # A SIGTERM (a time limit's) ends the run through the `finally` below, which stops the
        # server: it runs in a process group of its own, so it would otherwise outlive this one.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        proc = subprocess.Popen(shlex.split(a.launch), start_new_session=True)
    try:
        model = a.model or wait_ready(a.url, proc, a.api_key, a.launch_timeout)
        if a.model and proc is not None:
            wait_ready(a.url, proc, a.api_key, a.launch_timeout)
        t0 = time.perf_counter()
        points = sweep(a, model, ServerCpu(proc.pid) if proc is not None and os.path.isdir("/proc") else None)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)  # the server stops its own children
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # Anything the server left running in its process group would keep the GPU memory
            # and the port from the next server a script starts.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    data = {"label": a.label, "url": a.url, "model": model, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": f"{platform.node()} {platform.machine()} x{os.cpu_count()}", "python": sys.version.split()[0],
            "httpx": httpx.__version__, "args": {k: v for k, v in vars(a).items() if k != "api_key"},
            "seconds": round(time.perf_counter() - t0, 1), "points": points}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
    if a.plots:
        for path in plot([(a.label, data)], a.plots):
            print(path)
    print(result_line(a.label, points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
