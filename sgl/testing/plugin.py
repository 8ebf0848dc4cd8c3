"""sgl's pytest plugin (the `sgl` entry point of `pytest11`, loaded wherever sgl is
installed): fixtures for engines that tests of an app use, and `--sgl-model-path`.

- `sgl_null_engine` (module): a real engine on the null model, as a BackgroundEngine
  (AsyncEngine's calls, awaitable from any test's loop); with `--sgl-model-path PATH`, the
  model at PATH instead, so the same tests run on real weights.
- `sgl_served_app` (module): sgl's HTTP app over that engine on 127.0.0.1 (a ServedApp:
  `url`, `openai_url`, `model_name`, `engine`).
- `sgl_server_args` (module): the engines' server arguments; override it in a module or a
  conftest. `sgl_engine_recipe` (module) is what the engine fixtures start.

After each test that used an engine fixture, that fixture's check runs: for the real
engine, no request is left open and its KV accounting balances. `engine_fixture` makes an
engine fixture and its check in one function.

Importing this module imports neither torch nor the engine (pytest imports it at every
start, in every project where sgl is installed): the fixtures start engines lazily."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol, TypeVar

import pytest

from sgl.testing.contract import assert_no_leaks
from sgl.testing.engines import BackgroundEngine, EngineRecipe, ServedApp

F = TypeVar("F", bound=Callable[..., Any])

# Engine fixtures by name, each with what must hold of its engine after every test that used it.
AFTER_EACH_TEST: dict[str, Callable[[Any], None]] = {}


Scope = Literal["session", "package", "module", "class", "function"]


def engine_fixture(after_each_test: Callable[[Any], None], scope: Scope = "module") -> Callable[[F], Any]:
    """Make `fn` a pytest fixture of `scope` whose value `after_each_test` checks after every
    test that used it (or used a fixture built on it). An engine fixture is one such function:

        @engine_fixture(after_each_test=check_fake_engine_idle, scope="function")
        def sgl_fake_engine(...) -> FakeEngine: ..."""

    def register(fn: F) -> Any:
        AFTER_EACH_TEST[fn.__name__] = after_each_test
        return pytest.fixture(scope=scope)(fn)

    return register


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
