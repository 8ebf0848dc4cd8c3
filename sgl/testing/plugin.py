"""sgl's pytest plugin (the `sgl` entry point of `pytest11`, loaded wherever sgl is
installed): fixtures for engines that tests of an app use, and `--sgl-model-path`.

- `sgl_null_engine` (module): a real engine on the null model, as a BackgroundEngine
  (AsyncEngine's calls, awaitable from any test's loop); with `--sgl-model-path PATH`, the
  model at PATH instead, so the same tests run on real weights.
- `sgl_served_app` (module): sgl's HTTP app over that engine on 127.0.0.1 (a ServedApp:
  `url`, `openai_url`, `model_name`, `engine`).
- `sgl_server_args` (module): the real engine's server arguments; override it in a module
  or a conftest. `sgl_engine_recipe` (module) is what `sgl_null_engine` starts.
- `sgl_fake_engine` (function): a FakeEngine answering with `sgl_fake_responder`
  (function; override it to script the answers).

After each test that used an engine fixture, that fixture's check runs: for the real
engine, no request is left open and its KV accounting balances; for the fake, no request
is left open. `engine_fixture` makes an engine fixture and its check in one function.

Importing this module imports neither torch nor the engine (pytest imports it at every
start, in every project where sgl is installed): the fixtures start engines lazily."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import pytest

from sgl.testing.contract import ContractViolation, assert_no_leaks
from sgl.testing.engines import BackgroundEngine, EngineRecipe, ServedApp

if TYPE_CHECKING:
    from sgl.testing.fake import FakeEngine, Responder

F = TypeVar("F", bound=Callable[..., Any])

# Engine fixtures by name, each with what must hold of its engine after every test that used it.
AFTER_EACH_TEST: dict[str, Callable[[Any], None]] = {}
# Loop time a fake engine's check gives streams left early to close.
FAKE_SETTLE_S = 1.0


Scope = Literal["session", "package", "module", "class", "function"]


def engine_fixture(after_each_test: Callable[[Any], None], scope: Scope = "module") -> Callable[[F], Any]:
    """Make `fn` a pytest fixture of `scope` whose value `after_each_test` checks after every
    test that used it (or used a fixture built on it). An engine fixture is one such function:

        @engine_fixture(after_each_test=check_fake_engine_idle, scope="function")
        def sgl_fake_engine(...) -> FakeEngine: ...

    `fn` may return its engine or yield it (code after the yield is its teardown). A
    function-scoped fixture's check runs before that teardown, which may close the engine."""

    def register(fn: F) -> Any:
        if scope == "function":
            return pytest.fixture(_checked_before_teardown(fn, after_each_test))
        AFTER_EACH_TEST[fn.__name__] = after_each_test
        return pytest.fixture(scope=scope)(fn)

    return register


def _checked_before_teardown(fn: Callable[..., Any], check: Callable[[Any], None]) -> Callable[..., Iterator[Any]]:
    """`fn` as a generator fixture that gives its value, checks it after the test, then
    runs `fn`'s own teardown (even when the check fails)."""

    @functools.wraps(fn)  # pytest reads the fixture's arguments through __wrapped__
    def fixture(*args: Any, **kwargs: Any) -> Iterator[Any]:
        made = fn(*args, **kwargs)
        if not inspect.isgenerator(made):
            yield made
            check(made)
            return
        value = next(made)
        try:
            yield value
            check(value)
        finally:
            next(made, None)

    return fixture


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sgl", "sgl's test engines")
    group.addoption("--sgl-model-path", metavar="PATH", default=None,
                    help="run sgl's engine fixtures on the model at PATH (a Hugging Face directory or a "
                         ".gguf file) instead of the null model")


@pytest.fixture(scope="module")
def sgl_server_args() -> dict[str, Any]:
    """Server arguments for the module's engine fixtures (AsyncEngine's keyword
    arguments, over the test engines' defaults); override this fixture to set them."""
    return {}


@pytest.fixture(scope="module")
def sgl_engine_recipe(pytestconfig: pytest.Config, sgl_server_args: dict[str, Any]) -> EngineRecipe:
    """What the engine fixtures run: the null model, or `--sgl-model-path`'s model."""
    model_path = pytestconfig.getoption("sgl_model_path")
    if model_path:
        return EngineRecipe.real_model(model_path, **sgl_server_args)
    return EngineRecipe.null_model(**sgl_server_args)


class IdleCheckable(Protocol):
    """What the after-test check reads of an engine (a BackgroundEngine has it)."""

    @property
    def open_requests(self) -> int: ...

    def dead_reason(self) -> str | None: ...

    def idle_server_info(self) -> dict[str, Any]: ...


def check_idle_and_balanced(engine: IdleCheckable) -> None:
    """No request open, nothing running or waiting, every KV slot free or cached. A dead
    engine is left alone: its own error already failed the test that killed it."""
    if engine.dead_reason() is not None:
        return
    assert_no_leaks(engine.idle_server_info(), open_requests=engine.open_requests)


@engine_fixture(after_each_test=check_idle_and_balanced)
def sgl_null_engine(sgl_engine_recipe: EngineRecipe) -> Iterator[BackgroundEngine]:
    """A real engine on the null model (all three roles in this process; it starts in under
    half a second once torch is imported), or on `--sgl-model-path`'s model; shared by the
    module's tests."""
    with sgl_engine_recipe.background_engine() as engine:
        yield engine


@pytest.fixture
def sgl_fake_responder() -> Responder:
    """What `sgl_fake_engine` answers: a FakeEngine responder (a text, a list of texts, a
    mapping from prompt to text, or a callable (prompt, SamplingParams) -> text). The
    default is FakeEngine's fixed text; override this fixture to script the answers."""
    from sgl.testing.fake import DEFAULT_TEXT

    return DEFAULT_TEXT


def check_fake_engine_idle(engine: FakeEngine) -> None:
    """No request left open in a fake engine (`leak-open`): every generate returned, every
    stream ended or was closed. A dead engine is left alone.

    A stream left early closes on its loop's next turns: when the test's loop is still open
    and idle, it turns (up to a second of loop time) until none is open. The fake's
    scheduler side is not read: the test's loop is usually gone by now, so an abort sent as
    it ended may never have reached it (`await assert_engine_clean(engine)` inside a test
    checks it)."""
    if engine.dead_reason() is not None:
        return
    loop = engine.tm.loop
    if engine.open_requests and loop is not None and not loop.is_closed() and not loop.is_running():
        loop.run_until_complete(_requests_closed(engine, FAKE_SETTLE_S))
    if engine.open_requests:
        raise ContractViolation("leak-open", f"engine: {engine.open_requests} request(s) still open")


async def _requests_closed(engine: FakeEngine, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.open_requests and loop.time() < deadline:
        await asyncio.sleep(0.001)


@engine_fixture(after_each_test=check_fake_engine_idle, scope="function")
def sgl_fake_engine(sgl_fake_responder: Responder) -> Iterator[FakeEngine]:
    """A FakeEngine answering with `sgl_fake_responder`, new for each test (a fake belongs
    to the first event loop that uses it); shut down after the test and its check."""
    from sgl.testing.fake import FakeEngine

    engine = FakeEngine(sgl_fake_responder)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sgl_served_app(sgl_null_engine: BackgroundEngine) -> Iterator[ServedApp]:
    """sgl's HTTP app over `sgl_null_engine`, on 127.0.0.1 at a free port."""
    with ServedApp.start(sgl_null_engine) as app:
        yield app


@pytest.fixture(autouse=True)
def _sgl_engines_left_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    # The test's fixture values as set up: an engine fixture whose start failed is not
    # started again here (its error already failed the test).
    values = getattr(request.node, "funcargs", {})
    for name, check in AFTER_EACH_TEST.items():
        if name in values:
            check(values[name])
