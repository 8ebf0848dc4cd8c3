"""Real engines for tests, fast and exact: the public null model (its directory and the
continuation it gives), engines on it with all three roles in one process, an engine on
its own loop thread that any event loop may call, and sgl's HTTP app served over one.

It imports neither torch nor the engine until an engine starts: the pytest plugin
imports it at collection. It changes nothing of the engine: every helper starts the real
AsyncEngine, Engine or HTTP app with ordinary server arguments."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sgl.sched.models.null import DeviceTime, null_next_token

if TYPE_CHECKING:
    from sgl.engine import AsyncEngine, Engine

T = TypeVar("T")

# The default model's tokenizer (SmolLM2's): its vocabulary and end-of-sequence id.
TOKENIZER_VOCAB = 49_152
TOKENIZER_EOS = 2
# Without a tokenizer: a small vocabulary whose last id is the end-of-sequence id.
PLAIN_VOCAB = 1_000
NULL_CONTEXT_LENGTH = 8_192
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# What every test engine runs with unless told otherwise: all three roles in this process.
TEST_ENGINE_ARGS: Mapping[str, Any] = {"transport": "inproc"}
# The null model's KV pool: twice its context (a longest request fits with room to spare),
# a quarter of the CPU default, so it is allocated in a few milliseconds. Its HTTP name is
# fixed: its directory is a temporary one.
NULL_MODEL_NAME = "null"
NULL_ENGINE_ARGS: Mapping[str, Any] = {"load_format": "null", "max_total_tokens": 2 * NULL_CONTEXT_LENGTH,
                                       "served_model_name": NULL_MODEL_NAME}
IDLE_TIMEOUT_S = 10.0


# ---- the null model ------------------------------------------------------------------

def null_continuation(last_token: int, n: int, vocab_size: int = TOKENIZER_VOCAB) -> list[int]:
    """The n tokens the null model decodes greedily after a prompt ending in `last_token`
    (before any stop rule: an end-of-sequence id or a stop id in it ends the output there)."""
    out = []
    for _ in range(n):
        last_token = null_next_token(last_token, vocab_size)
        out.append(last_token)
    return out


def null_model_dir(path: str | os.PathLike[str] | None = None, *, vocab_size: int | None = None,
                   with_tokenizer: bool = True, context_length: int = NULL_CONTEXT_LENGTH,
                   device_time: DeviceTime | None = None) -> str:
    """Write a model directory for `load_format="null"` and return its path (`path`, or a
    new temporary directory that the caller owns).

    With a tokenizer (the default model's files, copied in) prompts and outputs are text;
    `vocab_size` then defaults to the tokenizer's 49,152 ids and may only be larger (the
    columns past them are never a text's token), and the end-of-sequence id is 2. Without
    one, requests carry input_ids, `vocab_size` defaults to 1,000 and its last id ends a
    sequence. The generation config makes greedy decoding the default, so a request that
    sets no temperature gets `null_continuation` of its prompt. With `device_time` each
    forward takes that long, as a device's would (CPU engines only)."""
    vocab = vocab_size or (TOKENIZER_VOCAB if with_tokenizer else PLAIN_VOCAB)
    if with_tokenizer and vocab < TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer's {TOKENIZER_VOCAB} ids")
    eos = TOKENIZER_EOS if with_tokenizer else vocab - 1
    out = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="sgl-null-model-"))
    out.mkdir(parents=True, exist_ok=True)
    # The null model reads only vocab_size; the rest makes a valid Llama config for the loaders.
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": context_length, "bos_token_id": 1,
              "eos_token_id": eos}
    if device_time is not None:
        config[DeviceTime.CONFIG_KEY] = device_time.to_config()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "temperature": 0.0}))
    if with_tokenizer:
        from sgl.sched.models.default_model import default_model_dir

        source = Path(default_model_dir())
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    return str(out)


# ---- what a test engine runs ---------------------------------------------------------

@dataclass(frozen=True)
class EngineRecipe:
    """What a test engine runs: the null model (`model_path` None: a directory that
    null_model_dir writes for the engine's lifetime) or a model directory, with server
    arguments over TEST_ENGINE_ARGS (and NULL_ENGINE_ARGS for the null model)."""

    model_path: str | None = None
    null: bool = True
    server_args: Mapping[str, Any] = field(default_factory=dict)
    device_time: DeviceTime | None = None  # the null model's time per forward, in the directory it writes

    @classmethod
    def null_model(cls, device_time: DeviceTime | None = None, **server_args: Any) -> EngineRecipe:
        """The null model; `model_path` among the arguments gives it that directory's config
        and tokenizer; `device_time` makes each forward take time (null_model_dir's)."""
        model_path = server_args.pop("model_path", None)
        if model_path is not None and device_time is not None:
            raise ValueError("device_time is written into a null model directory this recipe makes; with "
                             "model_path, write it there: null_model_dir(path, device_time=...)")
        return cls(model_path, True, server_args, device_time)

    @classmethod
    def real_model(cls, model_path: str, **server_args: Any) -> EngineRecipe:
        return cls(model_path, False, server_args)

    def engine_args(self, model_path: str) -> dict[str, Any]:
        return {**TEST_ENGINE_ARGS, **(NULL_ENGINE_ARGS if self.null else {}), **self.server_args,
                "model_path": model_path}

    @contextmanager
    def arguments(self) -> Iterator[dict[str, Any]]:
        """The engine's keyword arguments, with its model directory present while inside."""
        if self.model_path is not None:
            yield self.engine_args(self.model_path)
            return
        with tempfile.TemporaryDirectory(prefix="sgl-null-model-") as d:
            yield self.engine_args(null_model_dir(d, device_time=self.device_time))

    @asynccontextmanager
    async def async_engine(self) -> AsyncIterator[AsyncEngine]:
        """An AsyncEngine on the running loop, started without blocking it."""
        from sgl.engine import AsyncEngine

        with self.arguments() as kwargs:
            async with await AsyncEngine.start(**kwargs) as engine:
                yield engine

    @contextmanager
    def sync_engine(self) -> Iterator[Engine]:
        from sgl.engine import Engine

        with self.arguments() as kwargs, Engine(**kwargs) as engine:
            yield engine

    @contextmanager
    def background_engine(self) -> Iterator[BackgroundEngine]:
        with self.arguments() as kwargs, BackgroundEngine.start(**kwargs) as engine:
            yield engine


def null_engine(**server_args: Any) -> AbstractAsyncContextManager[AsyncEngine]:
    """`async with null_engine() as engine:` an AsyncEngine on the null model with the
    default model's tokenizer, its three roles in this process; `server_args` as AsyncEngine's,
    and `device_time=DeviceTime(...)` for forwards that take time."""
    return EngineRecipe.null_model(**server_args).async_engine()


def null_sync_engine(**server_args: Any) -> AbstractContextManager[Engine]:
    """`with null_sync_engine() as engine:` the same, as an `sgl.Engine`."""
    return EngineRecipe.null_model(**server_args).sync_engine()


# ---- an engine any loop may call -----------------------------------------------------

class LoopThread:
    """An event loop on a daemon thread, serving callers on other threads and loops."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError(f"{self.name} has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on this loop and wait for it (blocking the calling thread)."""
        return self.submit(coro).result()

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro`, run on this loop, from another loop; cancelling the awaiting task
        cancels it there."""
        return await asyncio.wrap_future(self.submit(coro))

    async def iterate(self, make: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
        """Iterate, from another loop, an async iterator that `make` builds on this loop.
        Leaving early cancels it there."""
        caller = asyncio.get_running_loop()
        items: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

        def send(done: bool, item: Any) -> None:
            try:
                caller.call_soon_threadsafe(items.put_nowait, (done, item))
            except RuntimeError:  # the caller's loop has closed: nobody is left to read
                pass

        async def pump() -> None:
            try:
                async for item in make():
                    send(False, item)
            except BaseException as e:  # the consumer learns of every end, a cancellation too
                send(True, e)
                raise
            send(True, None)

        pumping = self.submit(pump())
        try:
            while True:
                done, item = await items.get()
                if done:
                    if item is not None:
                        raise item
                    return
                yield item
        finally:
            pumping.cancel()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class BackgroundEngine:
    """An AsyncEngine on its own loop thread, with AsyncEngine's calls (the same
    signatures) awaitable from any event loop: the tests of a module may each run their
    own loop (asyncio.run, pytest-asyncio, anyio) against one engine, which an AsyncEngine,
    bound to the first loop that uses it, does not allow. Cancelling a call or leaving a
    stream early aborts its requests, as on the engine itself.

    `engine` is the AsyncEngine itself, for code run on `loop_thread` (the HTTP app)."""

    def __init__(self, engine: AsyncEngine, loop_thread: LoopThread) -> None:
        self.engine = engine
        self.loop_thread = loop_thread
        self._closed = False

    @classmethod
    def start(cls, model_path: str | None = None, **server_args: Any) -> BackgroundEngine:
        """Start one (blocking until its roles are ready); arguments as AsyncEngine's."""
        from sgl.engine import AsyncEngine

        loop_thread = LoopThread("sgl-background-engine")
        try:
            engine = loop_thread.run(AsyncEngine.start(model_path, **server_args))
        except BaseException:
            loop_thread.stop()
            raise
        return cls(engine, loop_thread)

    @property
    def args(self) -> Any:
        return self.engine.args

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def open_requests(self) -> int:
        return self.engine.open_requests

    def dead_reason(self) -> str | None:
        return self.engine.dead_reason()

    async def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        **options: Any,
    ) -> dict[str, Any] | list[Any]:
        return await self.loop_thread.call(self.engine.generate(prompt, sampling_params, input_ids, rid, **options))

    async def stream(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        **options: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        chunks = self.loop_thread.iterate(lambda: self.engine.stream(prompt, sampling_params, input_ids, rid,
                                                                     **options))
        async for chunk in chunks:
            yield chunk

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self.loop_thread.call(self.engine.abort(rid, abort_all))

    async def flush_cache(self) -> dict[str, Any]:
        return await self.loop_thread.call(self.engine.flush_cache())

    async def get_server_info(self) -> dict[str, Any]:
        return await self.loop_thread.call(self.engine.get_server_info())

    async def health(self) -> bool:
        return await self.loop_thread.call(self.engine.health())

    def idle_server_info(self, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
        """Blocking: the scheduler's info once no request is open here and none runs or
        waits there (aborts travel asynchronously), or as it stands at the timeout."""
        return self.loop_thread.run(server_info_when_idle(self.engine, timeout))

    async def aclose(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's roles and its loop thread; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self.loop_thread.run(self.engine.aclose())
        finally:
            self.loop_thread.stop()

    async def __aenter__(self) -> BackgroundEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> BackgroundEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


async def server_info_when_idle(engine: Any, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """An engine's server info once no request is open in it and none runs or waits in its
    scheduler, or as it stands at the timeout; awaited on the engine's loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        info: dict[str, Any] = await engine.get_server_info()
        idle = engine.open_requests == 0 and info["running"] == 0 and info["waiting"] == 0
        if idle or loop.time() > deadline:
            return info
        await asyncio.sleep(0.01)


# ---- the HTTP app --------------------------------------------------------------------

class ServedApp:
    """sgl's HTTP app (sgl/server: the native and OpenAI routes, their SSE framing and
    error bodies) over a BackgroundEngine, served by uvicorn on the engine's own loop, as
    `sgl serve` does, on a free port of 127.0.0.1. For httpx and the openai client:
    `openai.OpenAI(base_url=app.openai_url, api_key=...)`."""

    STOP_GRACE_S = 2  # open connections get this long to finish once the server stops

    def __init__(self, engine: BackgroundEngine, server: Any, serving: Future[None], sock: socket.socket) -> None:
        self.engine = engine
        self.model_name: str = server.config.app.state.sgl.model_name  # what the OpenAI routes answer to
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._server = server
        self._serving = serving
        self._sock = sock

    @classmethod
    def start(cls, engine: BackgroundEngine, host: str = "127.0.0.1") -> ServedApp:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen(128)
            server = _uvicorn_server(engine.engine, cls.STOP_GRACE_S)
            serving = engine.loop_thread.submit(server.serve(sockets=[sock]))
            engine.loop_thread.run(_started(server, serving))
        except BaseException:
            sock.close()
            raise
        return cls(engine, server, serving, sock)

    @property
    def openai_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        """Stop serving (blocking); the engine goes on."""
        self._server.should_exit = True
        try:
            self._serving.result()
        finally:
            self._sock.close()

    def __enter__(self) -> ServedApp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _uvicorn_server(engine: AsyncEngine, grace_s: int) -> Any:
    import uvicorn

    from sgl.server.app import build_app

    # log_config=None: uvicorn leaves the process's logging as the test runner set it.
    config = uvicorn.Config(build_app(engine), log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=grace_s, timeout_keep_alive=5)
    return uvicorn.Server(config)


async def _started(server: Any, serving: Future[None]) -> None:
    """Until uvicorn serves; its start-up error if it stops first."""
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError("uvicorn stopped before it started serving")
        await asyncio.sleep(0.005)

