"""The `sgl` pytest plugin, as an app's test suite meets it: pytester runs small test files
that use its fixtures (the null engine from any loop, the served app with the openai
client and httpx, server arguments, `--sgl-model-path` with the default model, the fake
engine and its responder), in a fresh interpreter as an installed plugin is loaded. Its
after-test checks fail on leftovers, and importing it imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from sgl.testing.plugin import check_idle_and_balanced

pytest_plugins = ["pytester"]

APP_TESTS = '''
import asyncio
import json

import httpx
import openai
import pytest

from sgl.testing.engines import null_continuation


@pytest.fixture(scope="module")
def sgl_server_args():
    return {"max_total_tokens": 4096}


def test_the_engine_serves_each_tests_own_loop(sgl_null_engine):
    async def main():
        out = await sgl_null_engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 4})
        chunks = [c async for c in sgl_null_engine.stream(input_ids=[5, 6], sampling_params={"max_new_tokens": 4})]
        return out, chunks, await sgl_null_engine.get_server_info()

    out, chunks, info = asyncio.run(main())
    assert out["output_ids"] == null_continuation(6, 4)
    assert [t for c in chunks for t in c["output_ids"]] == out["output_ids"]
    assert info["max_total_tokens"] == 4096  # sgl_server_args reached the engine


@pytest.mark.anyio
async def test_and_an_anyio_test_on_the_same_engine(sgl_null_engine):
    out = await sgl_null_engine.generate(input_ids=[9], sampling_params={"max_new_tokens": 2})
    assert out["output_ids"] == null_continuation(9, 2)


def test_the_openai_client_on_the_served_app(sgl_served_app):
    client = openai.OpenAI(base_url=sgl_served_app.openai_url, api_key="unused", max_retries=0)
    done = client.completions.create(model=sgl_served_app.model_name, prompt="Hello there", max_tokens=4)
    direct = asyncio.run(sgl_served_app.engine.generate("Hello there", {"max_new_tokens": 4}))
    assert done.choices[0].text == direct["text"]
    assert done.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=sgl_served_app.model_name, max_tokens=5, stream=True,
                                            messages=[{"role": "user", "content": "Hi"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=sgl_served_app.model_name, prompt="Hi", temperature=-1)
    assert bad.value.body["param"] == "temperature"


def test_native_streams_in_sse_framing(sgl_served_app):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    with httpx.stream("POST", sgl_served_app.url + "/generate", json=body) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    # One event a token, fewer where chunks a slow reader missed were joined; each holds the ids so far.
    assert 2 <= len(events) <= 4 and len(json.loads(events[-2][len("data: "):])["output_ids"]) == 3
'''

MODEL_PATH_TEST = '''
import asyncio

import pytest

from sgl.testing.engines import null_continuation


@pytest.fixture(scope="module")
def sgl_server_args():
    return {"max_total_tokens": 2048}  # the CPU default would allocate 3 GB of KV for SmolLM2


def test_the_fixture_runs_the_given_model(sgl_null_engine, pytestconfig):
    assert sgl_null_engine.args.load_format != "null"
    assert sgl_null_engine.model_path == pytestconfig.getoption("sgl_model_path")
    prompt = "The capital of France is"
    out = asyncio.run(sgl_null_engine.generate(prompt, {"max_new_tokens": 3, "temperature": 0}))
    assert out["meta_info"]["completion_tokens"] == 3
    last = sgl_null_engine.tokenizer.encode(prompt)[-1]
    assert out["output_ids"] != null_continuation(last, 3)  # weights, not the null rule
    assert asyncio.run(sgl_null_engine.get_server_info())["max_total_tokens"] == 2048
'''


def _start(pytester: pytest.Pytester, test_file: str, *args: str) -> tuple[subprocess.Popen[str], float]:
    """pytest on `test_file` in a fresh interpreter, as an app's suite runs it (the plugin
    comes in through its entry point); Hypothesis's plugin stays out, as these files use none."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
           f"--basetemp={pytester.path / ('tmp-' + test_file)}", test_file, *args]
    return pytester.popen(cmd, stdin=subprocess.DEVNULL, text=True), time.monotonic()


def _outcomes(run: tuple[subprocess.Popen[str], float]) -> dict[str, int]:
    proc, began = run
    out, err = proc.communicate(timeout=300)
    result = pytest.RunResult(proc.returncode, out.splitlines(), err.splitlines(), time.monotonic() - began)
    outcomes = result.parseoutcomes()
    assert proc.returncode == 0, f"{outcomes}\n{out}\n{err}"
    return outcomes


@pytest.fixture(scope="session")
def default_model() -> tuple[str, str]:
    """The default model's directory and sgl's cache folder, found before pytester points
    HOME at its own folder (where the inner runs would convert the model again)."""
    from sgl.sched.models.default_model import cache_root, default_model_dir

    return default_model_dir(), str(cache_root())


def test_the_fixtures_on_the_null_model_and_on_real_weights(pytester: pytest.Pytester, default_model: tuple[str, str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir, cache = default_model
    monkeypatch.setenv("SGL_CACHE_DIR", cache)
    pytester.makepyfile(test_app=APP_TESTS, test_model=MODEL_PATH_TEST)
    # Both runs at once: each spends seconds importing torch and starting its engine.
    app = _start(pytester, "test_app.py")
    model = _start(pytester, "test_model.py", f"--sgl-model-path={model_dir}")
    try:
        assert _outcomes(app) == {"passed": 4}
        assert _outcomes(model) == {"passed": 1}
    finally:
        for proc, _ in (app, model):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


LEAK_TESTS = '''
from sgl.testing.plugin import engine_fixture


def fail(engine):
    raise AssertionError(f"{engine} left a request open")


@engine_fixture(after_each_test=fail, scope="function")
def leaky_engine():
    return "the leaky engine"


def test_uses_it(leaky_engine):
    pass


def test_uses_none():
    pass


class Closable:
    closed = False


def still_open(engine):
    assert not engine.closed, "checked after its teardown"


@engine_fixture(after_each_test=still_open, scope="function")
def closing_engine():
    engine = Closable()
    yield engine
    engine.closed = True


def test_uses_one_its_teardown_closes(closing_engine):
    pass
'''


def test_an_engine_fixtures_check_fails_each_test_that_used_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_leak=LEAK_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_uses_it*", "*the leaky engine left a request open*"])


FAKE_TESTS = '''
import asyncio

import pytest

import sgl
from sgl.testing import Die, run_virtual

LOOP = asyncio.new_event_loop()  # a loop that outlives each test, as some async test frameworks keep one
KEPT = []


def test_the_default_answer(sgl_fake_engine):
    assert asyncio.run(sgl_fake_engine.generate("Hi"))["text"] == "This is a fake answer."


def test_a_new_engine_for_each_tests_loop(sgl_fake_engine):
    assert run_virtual(sgl_fake_engine.generate("Hi"))["text"] == "This is a fake answer."


class TestAScriptedResponder:
    @pytest.fixture
    def sgl_fake_responder(self):
        return lambda prompt, params: prompt.upper()

    def test_it_answers(self, sgl_fake_engine):
        assert asyncio.run(sgl_fake_engine.generate("shout"))["text"] == "SHOUT"


def test_a_stream_left_early_closes_on_its_loop(sgl_fake_engine):
    async def main():
        async for _ in sgl_fake_engine.stream("Hi"):
            break

    LOOP.run_until_complete(main())


def test_a_dead_engine_is_left_alone(sgl_fake_engine):
    async def main():
        kept = sgl_fake_engine.stream("Hi")
        await kept.__anext__()
        KEPT.append(kept)
        sgl_fake_engine.faults.next_request(Die(after_tokens=2))
        with pytest.raises(sgl.EngineDeadError):
            async for _ in sgl_fake_engine.stream("Hello"):
                pass

    LOOP.run_until_complete(main())
    assert sgl_fake_engine.open_requests == 1


def test_a_stream_kept_open(sgl_fake_engine):
    async def main():
        stream = sgl_fake_engine.stream("Hi")
        await stream.__anext__()
        KEPT.append(stream)

    LOOP.run_until_complete(main())
'''


def test_the_fake_engine_fixture(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fake=FAKE_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest")
    result.assert_outcomes(passed=6, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a_stream_kept_open*",
                                 "*[[]leak-open[]] engine: 1 request(s) still open*"])


def test_importing_the_plugin_imports_no_torch() -> None:
    code = ("import json, sys; import sgl.testing.plugin, sgl.testing.engines; "
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


# ---- the after-test check, on engines that left something behind -------------------

BALANCED = {"running": 0, "waiting": 0, "kv_protected": 0, "kv_free": 90, "kv_evictable": 10,
            "max_total_tokens": 100, "invariant_violations": 0}


class Leftovers:
    """What check_idle_and_balanced reads of an engine, as a test may leave it."""

    def __init__(self, open_requests: int = 0, dead: str | None = None, **info: Any) -> None:
        self.open_requests = open_requests
        self.info = {**BALANCED, **info}
        self.dead = dead

    def dead_reason(self) -> str | None:
        return self.dead

    def idle_server_info(self) -> dict[str, Any]:
        return self.info


@pytest.mark.parametrize(("leftover", "message"), [
    (Leftovers(open_requests=1), r"\[leak-open\]"),
    (Leftovers(running=1), r"\[leak-requests\].*'running': 1"),
    (Leftovers(waiting=2), r"\[leak-requests\].*'waiting': 2"),
    (Leftovers(kv_protected=3), r"\[leak-protected\]"),
    (Leftovers(kv_free=80), r"\[leak-kv\]"),
    (Leftovers(invariant_violations=1), r"\[leak-invariants\]"),
])
def test_the_check_names_what_was_left(leftover: Leftovers, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_idle_and_balanced(leftover)


def test_the_check_passes_a_clean_engine_and_leaves_a_dead_one_alone() -> None:
    check_idle_and_balanced(Leftovers())
    check_idle_and_balanced(Leftovers(running=1, dead="the scheduler died"))
