"""W8's load generator (benchmarks/w8_online.py) against a real `sgl serve` with the null
model and the default model's tokenizer: a Poisson point and a concurrency point of w2 and
chat, every request whole, percentiles ordered, the JSON file read back the same; the edit
workload's concurrency points alone, and its prompts (docs passages with typos) offline."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from benchmarks import w8_online
from tests.serve_util import ServerProc

REQUESTS = 16
CAP = 12  # output tokens at most per request: short, so the test stays fast


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProc]:
    from sgl.sched.models.default_model import default_model_dir

    s = ServerProc("--model-path", default_model_dir(), "--load-format", "null", "--max-total-tokens", "40000",
                   "--context-length", "4096")
    yield s
    assert s.stop(signal.SIGTERM) == 0


def test_points(server: ServerProc, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w8.json"
    assert w8_online.main(["--url", server.url, "--workloads", "w2,chat", "--rates", "20", "--concurrency", "4",
                           "--requests", str(REQUESTS), "--warmup", "1", "--output-cap", str(CAP),
                           "--json", str(out), "--label", "test"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT w8 label=test failed=0 ")
    data = json.loads(out.read_text())
    points = data["points"]
    assert [(p["workload"], p["mode"], p["value"]) for p in points] == [
        ("w2", "rate", 20.0), ("w2", "concurrency", 4.0), ("chat", "rate", 20.0), ("chat", "concurrency", 4.0)]
    for p in points:
        assert p["ok"] == p["requests"] == REQUESTS and p["failed"] == 0 and p["errors"] == [], p
        asked = sum(r.max_tokens for r in w8_online.make_requests(p["workload"], REQUESTS, 1, 0, 0.6, CAP))
        assert p["out_tokens"] == asked
        assert p["tokens_from"] == "usage"
        for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            q = p[k]
            assert q["p50"] is not None and 0 <= q["p50"] <= q["p90"] <= q["p99"], (k, q)
        assert p["ttft_ms"]["p99"] <= p["e2e_ms"]["p99"]
        assert p["req_s"] > 0 and p["out_tok_s"] > 0 and p["client_cpu_us_per_chunk"] > 0
        if p["mode"] == "concurrency":
            assert p["max_in_flight"] == p["value"]
        # The server's counters cover this point alone: a decode step gives each running request a
        # token, and each request takes CAP - 1 of them after its prefill's.
        engine = p["engine"]
        assert CAP - 1 <= engine["decode_steps"] <= p["out_tokens"] - p["requests"], engine
        assert engine["prefill_tokens"] + engine["cached_tokens"] >= p["requests"] and engine["build_s"] > 0
    # The file holds plain JSON (no Infinity) and reads back as it was written.
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_points_split_keeps_the_concurrency() -> None:
    """A concurrency point's workers over the client processes add up to the concurrency
    asked (at concurrency 1 with 4 processes, one process and one worker, not 4); every
    request goes to exactly one process; a rate point's processes each get requests."""
    for n, procs, workers in [(64, 4, 1), (64, 4, 4), (64, 4, 16), (64, 4, 6), (3, 4, 16), (64, 1, 64)]:
        shares, share_workers = w8_online.split_point(n, procs, workers)
        assert sum(share_workers) == workers and min(share_workers) >= 1
        assert len(shares) <= min(procs, n, workers)
        assert sorted(i for s in shares for i in s) == list(range(n))
    shares, share_workers = w8_online.split_point(10, 4, None)
    assert len(shares) == 4 and all(shares) and sorted(i for s in shares for i in s) == list(range(10))
    recs = [w8_online.Record(i, sent=float(i), e2e=1.5) for i in range(4)]
    assert w8_online.max_in_flight(recs) == 2


def test_arrivals_and_percentiles() -> None:
    sends = w8_online.arrivals(2000, 50.0, seed=1)
    assert sends == sorted(sends) and sends[0] == 0.0
    assert math.isclose(len(sends) / sends[-1], 50.0, rel_tol=0.1)
    assert w8_online.arrivals(3, math.inf, seed=1) == [0.0, 0.0, 0.0]
    q = w8_online.percentiles([i / 1e3 for i in range(101)])  # 0..100 ms
    assert (q["p50"], q["p90"], q["p99"], q["mean"]) == (50.0, 90.0, 99.0, 50.0)
    assert w8_online.percentiles([])["p50"] is None


def test_edit_through_server(server: ServerProc, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The edit workload, concurrency points only (`--rates none`): every request ends well
    within its max_tokens (no ignore_eos, so the model may stop early)."""
    out = tmp_path / "edit.json"
    assert w8_online.main(["--url", server.url, "--workloads", "edit", "--rates", "none", "--concurrency", "1,4",
                           "--requests", "8", "--warmup", "1", "--output-cap", str(CAP), "--temperature", "0",
                           "--json", str(out), "--label", "edit"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("RESULT w8 label=edit failed=0 edit_")
    points = json.loads(out.read_text())["points"]
    assert [(p["workload"], p["mode"], p["value"]) for p in points] == [("edit", "concurrency", 1.0),
                                                                         ("edit", "concurrency", 4.0)]
    for k, p in enumerate(points, start=1):
        assert p["ok"] == p["requests"] == 8 and p["errors"] == [], p
        asked = sum(r.max_tokens for r in w8_online.make_requests("edit", 8, k, 0, 0.0, CAP))
        assert 0 < p["out_tokens"] <= asked


def test_point_values() -> None:
    assert w8_online.point_values("1,8") == [1.0, 8.0]
    assert w8_online.point_values("4,inf") == [4.0, math.inf]
    assert w8_online.point_values("") == w8_online.point_values("none") == w8_online.point_values("None") == []


def test_prose_runs() -> None:
    md = ("# Title\n\nFirst paragraph\nwraps here.\n\nSecond one.\n\n```bash\nsgl serve\n\nmore code\n```\n\n"
          "After the code.\n\n| a | b |\n|---|---|\n\n- a list item\n\n**Bold** prose.\n\n    indented code\n")
    assert w8_online.prose_runs(md) == [["First paragraph wraps here.", "Second one."], ["After the code."],
                                        ["**Bold** prose."]]


def test_doc_passages() -> None:
    passages = w8_online.doc_passages()
    assert len(passages) >= 16  # a point's worth of requests without repeats, at the default --requests of spec runs
    lo, hi = w8_online.EDIT_WORDS
    for text in passages:
        assert lo <= len(text.split()) <= hi, text
        assert "```" not in text and not any(line.startswith(("#", "|")) for line in text.splitlines()), text


def swapped(a: str, b: str) -> bool:
    """`b` is `a` with two adjacent letters swapped, neither the first nor the last letter."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return (len(a) == len(b) and len(diff) == 2 and diff[1] == diff[0] + 1
            and (a[diff[0]], a[diff[1]]) == (b[diff[1]], b[diff[0]])
            and 0 < diff[0] and diff[1] < len(a.rstrip(",.;:!?")) - 1)


def test_with_typos() -> None:
    import random

    text = w8_online.doc_passages()[0]
    noisy = w8_online.with_typos(text, random.Random(5))
    assert noisy == w8_online.with_typos(text, random.Random(5)) and noisy != text
    words, noisy_words = text.split(" "), noisy.split(" ")
    assert len(words) == len(noisy_words)
    changed = [(a, b) for a, b in zip(words, noisy_words) if a != b]
    assert 1 <= len(changed) <= max(1, round(w8_online.EDIT_TYPO_RATE * len(words)))
    assert all(swapped(a, b) for a, b in changed), changed


def test_edit_requests() -> None:
    reqs = w8_online.make_requests("edit", 12, 1, 0, 0.0)
    assert [r.body for r in reqs] == [r.body for r in w8_online.make_requests("edit", 12, 1, 0, 0.0)]
    passages = w8_online.doc_passages()
    prompts = set()
    for r in reqs:
        assert r.route == "/v1/chat/completions" and not r.exact and "ignore_eos" not in r.body
        assert r.body["temperature"] == 0.0
        system, user = r.body["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        instruction, noisy = user["content"].split("\n\n", 1)
        assert instruction == w8_online.EDIT_INSTRUCTION and noisy
        # The passage, with its typos: the same words but a few, each two letters swapped.
        (text,) = [p for p in passages if len(p.split(" ")) == len(noisy.split(" "))
                   and sum(a != b for a, b in zip(p.split(" "), noisy.split(" "))) <= 10]
        assert noisy != text
        assert all(swapped(a, b) for a, b in zip(text.split(" "), noisy.split(" ")) if a != b)
        assert 0 < r.max_tokens <= w8_online.EDIT_MAX_TOKENS and r.max_tokens == r.body["max_tokens"]
        assert r.max_tokens >= len(text.split())  # room for the copy
        prompts.add(user["content"])
    assert len(prompts) == len(reqs)  # no passage twice within a point
    other = w8_online.make_requests("edit", 12, 2, 0, 0.0)
    assert not {m["content"] for r in other for m in r.body["messages"]} & {
        m["content"] for r in reqs for m in r.body["messages"]}
    assert all(r.max_tokens <= 7 for r in w8_online.make_requests("edit", 4, 1, 0, 0.0, output_cap=7))


def test_stream_gaps_engine_level(null_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/stream_gaps.py on the null model: every request streamed whole at each
    concurrency and rate of each variant, percentiles ordered, the JSON rows as printed."""
    from benchmarks import stream_gaps

    out = tmp_path / "gaps.json"
    assert stream_gaps.main(["--model", null_model_dir, "--load-format", "null", "--concurrency", "1,3",
                             "--rates", "50", "--requests", "6", "--max-new", "3,6", "--prompt-len", "5,40",
                             "--vocab", "900", "--variants", '[{}, {"disable_overlap_schedule": false}]',
                             "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows, lens = data["rows"], data["args"]["new_lens"]
    assert len(lens) == 6 and all(3 <= n <= 6 for n in lens)
    assert [(r["variant"], r["point"]) for r in rows] == [
        ("{}", "c1"), ("{}", "c3"), ("{}", "r50"), ('{"disable_overlap_schedule": false}', "c1"),
        ('{"disable_overlap_schedule": false}', "c3"), ('{"disable_overlap_schedule": false}', "r50")]
    for r in rows:
        assert r["requests"] == 6 and r["out_tok_s"] > 0
        for k in ("ttft", "first_gap", "later_gap"):
            assert r[f"{k}_p50"] is not None and 0 <= r[f"{k}_p50"] <= r[f"{k}_p99"], (k, r)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("RESULT stream_gaps ")


def test_stream_gaps_text_prompts(default_config_dir: str, tmp_path: Path) -> None:
    """--text runs each variant again with the prompts as text, which the engine tokenizes:
    those rows are marked and every request streams whole."""
    from benchmarks import stream_gaps

    out = tmp_path / "gaps.json"
    assert stream_gaps.main(["--model", default_config_dir, "--load-format", "null", "--tokenizer", default_config_dir,
                             "--text", "--concurrency", "2", "--requests", "4", "--max-new", "4",
                             "--prompt-len", "5,30", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["inputs"], r["requests"]) for r in rows] == [("ids", 4), ("text", 4)]
    assert all(r["out_tok_s"] > 0 and r["first_gap_p50"] is not None for r in rows)


def test_tokenizer_turns(default_config_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/tokenizer_turns.py: encodes beside a busy loop at each switch interval,
    and the process's own interval is given back afterwards."""
    import sys

    from benchmarks import tokenizer_turns

    before = sys.getswitchinterval()
    assert tokenizer_turns.main(["--tokenizer", default_config_dir, "--words", "50", "--seconds", "0.2",
                                 "--intervals", "5,0.2"]) == 0
    assert sys.getswitchinterval() == before
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith(("5.0 ", "0.2 "))]
    assert len(rows) == 2 and all(int(r[1]) > 0 and float(r[2]) > 0 for r in rows)


def test_shared_stalls_tell_a_server_stall_from_a_stream_s_own() -> None:
    """Three streams of chunks every 2 ms: a 30 ms gap in all three at once is shared by
    every other open stream, also when each stream's chunks come a little apart from the
    others'; a 20 ms gap in one stream alone by none."""
    from benchmarks.w8_online import Record, shared_stalls

    def stream(times_ms: list[float]) -> Record:
        t = [x / 1e3 for x in times_ms]
        return Record(0, sent=0.0, ttft=t[0], gaps=[b - a for a, b in zip(t, t[1:])])

    steady = [float(x) for x in range(0, 200, 2)]
    held = [x if x < 100 else x + 30 for x in steady]  # everyone waits 30 ms at 100 ms
    assert shared_stalls([stream(held), stream(held), stream(held)]) == (3, 1.0)
    apart = [[x + d for x in held] for d in (0.0, 0.6, 1.3)]  # one step's chunks reach each stream later
    assert shared_stalls([stream(t) for t in apart]) == (3, 1.0)
    alone = [x if x < 50 else x + 20 for x in steady]  # one stream waits 20 ms at 50 ms
    assert shared_stalls([stream(alone), stream(steady), stream(steady)]) == (1, 0.0)
    assert shared_stalls([stream(steady)]) == (0, None)
    failed = stream(held)
    failed.error = "boom"
    assert shared_stalls([failed]) == (0, None)


def test_stalls_at_prompts_tell_a_prefill_s_hold_from_chance() -> None:
    """Two streams of chunks every 2 ms over a second. A third request sent at 300 ms
    answers its first token at 330 ms, and both streams wait 20 ms inside that: every stall
    came with a new prompt, where a window of their length meets that wait by chance only
    about 5% of the time. A stall away from any prompt counts for none."""
    from benchmarks.w8_online import Record, stalls_at_prompts

    def stream(index: int, times_ms: list[float], sent_ms: float = 0.0) -> Record:
        t = [x / 1e3 for x in times_ms]
        return Record(index, sent=sent_ms / 1e3, ttft=t[0] - sent_ms / 1e3, gaps=[b - a for a, b in zip(t, t[1:])],
                      e2e=t[-1] - sent_ms / 1e3)

    steady = [float(x) for x in range(0, 1000, 2)]
    held = [x for x in steady if not 306 < x < 326]  # a 20 ms hole while the newcomer's prompt waits
    newcomer = stream(2, [330.0, 332.0], sent_ms=300.0)
    share, chance = stalls_at_prompts([stream(0, held), stream(1, held), newcomer])
    assert share == 1.0 and chance is not None and 0.03 < chance < 0.07
    away = [x for x in steady if not 606 < x < 626]
    share, _ = stalls_at_prompts([stream(0, away), stream(1, steady), newcomer])
    assert share == 0.0
    assert stalls_at_prompts([stream(0, steady), newcomer]) == (None, None)


def test_server_cpu_counts_each_process_of_the_session(tmp_path: Path) -> None:
    """ServerCpu reads the CPU time of every process in a launched server's session (the
    server and the children it started), and nothing of this process's: a busy parent and
    its busy child both show a load near one, over the same wall time."""
    from benchmarks.w8_online import ServerCpu, server_cpu

    busy = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 3.0: pass\n"
    (tmp_path / "child.py").write_text(busy)
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys\n"
        f"c = subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}])\n" + busy + "c.wait()\n")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], start_new_session=True)
    try:
        cpu = ServerCpu(proc.pid)
        time.sleep(0.8)  # both started and busy
        cpu.take()
        t = time.perf_counter()
        time.sleep(1.0)
        rows = server_cpu(cpu.take(), time.perf_counter() - t, tokens=1000)
    finally:
        proc.wait(30)
    assert len(rows) == 2, rows
    assert all(r["pid"] != os.getpid() for r in rows)
    assert all(0.3 < r["load"] < 1.3 for r in rows), rows  # two cores: both may run at once
    assert any("child.py" in r["cmd"] for r in rows) and any("parent.py" in r["cmd"] for r in rows)


def test_engine_line_counts_the_steps_prefills_carried_and_the_owed_ones() -> None:
    c = {"decode_steps": 100.0, "mixed_steps": 7.0, "owed_steps": 3.0, "build_s": 0.05, "wait_s": 0.2,
         "process_s": 0.01}
    assert w8_online.engine_line(c) == ("100 decode steps (7 in prefills' forwards) (3 ahead of a waiting prompt); "
                                        "host ms per step build / wait / process 0.50 / 2.00 / 0.10")
    plain = w8_online.engine_line({**c, "mixed_steps": 0.0, "owed_steps": 0.0})
    assert plain.startswith("100 decode steps; host ms")
    assert w8_online.engine_line({}) == ""


# ---------------------------------------------------------------- two result files compared

def point(mode: str, value: float, lat: float = 10.0, tok_s: float = 1000.0, req_s: float = 5.0,
          failed: int = 0, workload: str = "w2") -> dict:
    q = {"p50": lat, "p90": lat * 2, "p99": lat * 3, "mean": lat}
    return {"workload": workload, "mode": mode, "value": "inf" if math.isinf(value) else value, "requests": 8,
            "ok": 8 - failed, "failed": failed, "req_s": req_s, "out_tok_s": tok_s, "ttft_ms": dict(q),
            "itl_ms": {k: v / 10 for k, v in q.items()}}


def result(label: str, points: list[dict]) -> dict:
    return {"label": label, "points": points}


sweeps = st.lists(st.sampled_from([1.0, 2.0, 4.0, 8.0, 16.0]), min_size=1, max_size=4, unique=True).flatmap(
    lambda rates: st.tuples(st.just(rates), st.lists(st.floats(1.0, 100.0), min_size=len(rates), max_size=len(rates)),
                            st.lists(st.floats(100.0, 1e5), min_size=1, max_size=3)))


@given(sweeps, st.floats(0.5, 2.0), st.floats(0.5, 2.0))
def test_compare_saturation_is_the_median_against_the_target(sweep: tuple, factor: float, target: float) -> None:
    """Equal latencies: met exactly when mine's saturation median is `target` times the peer's
    or more; the sweep against itself at target 1 is met (a tie is no worse)."""
    rates, lats, runs = sweep
    assume(abs(factor - target) > 1e-6)
    base = [point("rate", r, lat, req_s=100.0) for r, lat in zip(rates, lats)]
    peer = result("peer", base + [point("rate", math.inf, tok_s=t, req_s=100.0) for t in runs])
    mine = result("mine", base + [point("rate", math.inf, tok_s=t * factor, req_s=100.0) for t in runs[::-1]])
    assert w8_online.compare(peer, peer, 1.0).met
    verdict = w8_online.compare(mine, peer, target)
    assert verdict.met == (factor >= target), verdict.text
    assert "no worse at every point both sustain" in verdict.text


def test_compare_judges_latency_only_where_both_sustain() -> None:
    inf = [point("rate", math.inf, tok_s=t, req_s=10.0) for t in (900.0, 1200.0, 1000.0)]
    peer = result("vllm", [point("rate", 4, 10.0), point("rate", 16, 10.0), point("concurrency", 4, 10.0), *inf])
    faster = [point("rate", math.inf, tok_s=t * 1.2, req_s=12.0) for t in (900.0, 1200.0, 1000.0)]

    def mine(rate4: float, rate16: float, conc: float, failed: int = 0) -> dict:
        return result("sgl", [point("rate", 4, rate4, failed=failed), point("rate", 16, rate16),
                              point("concurrency", 4, conc), *faster])

    verdict = w8_online.compare(mine(10.0, 10.0, 9.0), peer, 1.15)
    assert verdict.met, verdict.text
    assert "sgl 1,200 tok/s (median of 1,080, 1,440, 1,200), vllm 1,000 tok/s" in verdict.text
    # Rate 16 is past the peer's saturation request rate (10/s): not judged.
    assert w8_online.compare(mine(10.0, 50.0, 9.0), peer, 1.15).met
    slow = w8_online.compare(mine(11.0, 10.0, 9.0), peer, 1.15)
    assert not slow.met and "rate 4 TTFT p50 (11.0 against 10.0)" in slow.text
    (latency,) = [line for line in slow.text.splitlines() if line.startswith("- latency")]
    assert "rate 4 ITL p99 (3.3 against 3.0)" in latency and "rate 16" not in latency
    assert not w8_online.compare(mine(10.0, 10.0, 12.0), peer, 1.15).met  # concurrency points are judged too
    # A point with a failed request is not sustained: its latency is shown, not judged.
    failing = w8_online.compare(mine(11.0, 10.0, 9.0, failed=1), peer, 1.15)
    assert failing.met and "| rate 4 | no |" in failing.text
    assert not w8_online.compare(mine(10.0, 10.0, 9.0), peer, 1.25).met
    # No saturation point in one file, or no workload in common: not met.
    assert not w8_online.compare(result("sgl", [point("rate", 4, 9.0)]), peer, 1.0).met
    assert not w8_online.compare(result("sgl", [point("rate", 4, 9.0, workload="chat")]), peer, 1.0).met


def test_compare_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peer = result("vllm", [point("rate", 4, 10.0), point("rate", math.inf, tok_s=1000.0)])
    mine = result("sgl", [point("rate", 4, 9.0), point("rate", math.inf, tok_s=1100.0)])
    files = []
    for d in (mine, peer):
        files.append(tmp_path / f"{d['label']}.json")
        files[-1].write_text(json.dumps(d))
    assert w8_online.main(["--compare", *map(str, files)]) == 1  # 1.10x against the default 1.15x
    assert "1.10x (target 1.15x), missed" in capsys.readouterr().out
    assert w8_online.main(["--compare", *map(str, files), "--target", "1.1"]) == 0
    assert capsys.readouterr().out.strip().endswith("**met**: sgl against vllm")
    line = w8_online.result_line("sgl", [point("rate", math.inf, tok_s=t) for t in (3.0, 1.0, 2.0)])
    assert "w2_sat_tok_s=2 w2_max_tok_s=3" in line
