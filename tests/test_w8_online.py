"""W8's load generator (benchmarks/w8_online.py) against a real `sgl serve` with the null
model and the default model's tokenizer: a Poisson point and a concurrency point of each
workload, every request whole, percentiles ordered, the JSON file read back the same."""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    # The file holds plain JSON (no Infinity) and reads back as it was written.
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_arrivals_and_percentiles() -> None:
    sends = w8_online.arrivals(2000, 50.0, seed=1)
    assert sends == sorted(sends) and sends[0] == 0.0
    assert math.isclose(len(sends) / sends[-1], 50.0, rel_tol=0.1)
    assert w8_online.arrivals(3, math.inf, seed=1) == [0.0, 0.0, 0.0]
    q = w8_online.percentiles([i / 1e3 for i in range(101)])  # 0..100 ms
    assert (q["p50"], q["p90"], q["p99"], q["mean"]) == (50.0, 90.0, 99.0, 50.0)
    assert w8_online.percentiles([])["p50"] is None
