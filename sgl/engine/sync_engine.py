"""The synchronous engine for scripts, REPLs and notebooks: a private event loop on
one background thread runs an AsyncEngine, so `Engine` works even where the
caller's thread already has a running loop (a notebook)."""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from sgl.core.protocol import MemoryTag, PauseMode
from sgl.core.server_args import ServerArgs
from sgl.engine.async_engine import AsyncEngine
from sgl.engine.batch_args import check_stream_args


class _Done:
    pass


class Engine:
    """The synchronous engine for scripts, REPLs and notebooks.

    `Engine(model_path=None, transport="ipc", **server_args)`; `generate` returns a
    dict (a list for a batch) or, with `stream=True`, an iterator of delta chunks.

    It installs no signal handler. A script killed by SIGTERM (or SIGKILL) leaves
    nothing behind all the same: its child roles see the parent go, remove the ipc
    socket folder and exit (sgl/runtime/child.py)."""

    def __init__(self, model_path: str | None = None, transport: str = "ipc", **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sgl-engine-loop", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._engine = AsyncEngine(model_path, transport=transport, **kwargs)
        except BaseException:
            self._stop_loop()
            raise
        atexit.register(self.shutdown)

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def server_args(self) -> ServerArgs:
        return self._engine.args

    def _run(self, coro: Any) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError("this engine has been shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **options: Any,
    ) -> Any:
        """As AsyncEngine.generate (same options); `stream=True` gives an iterator of chunks."""
        if stream:
            # Fail here, not in the first next().
            check_stream_args(prompt, sampling_params, input_ids, rid, options)
            return self._stream(prompt, sampling_params, input_ids, rid, options)
        return self._run(self._engine.generate(prompt, sampling_params, input_ids, rid, **options))

    def _stream(
        self, prompt: Any, sp: Any, input_ids: Any, rid: Any, options: dict[str, Any]
    ) -> Iterator[dict[str, Any]]:
        q: queue.Queue[Any] = queue.Queue()
        if self._closed:
            raise RuntimeError("this engine has been shut down")
        fut = asyncio.run_coroutine_threadsafe(self._pump(q.put, prompt, sp, input_ids, rid, options), self._loop)
        try:
            while (item := q.get()) is not _Done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not fut.done():
                self._loop.call_soon_threadsafe(fut.cancel)

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        dimensions: int | None = None,
    ) -> Any:
        """As AsyncEngine.encode: each prompt's {"embedding", "meta_info"}."""
        return self._run(self._engine.encode(prompt, input_ids, rid, dimensions))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **options: Any,
    ) -> Any:
        """The awaitable twin of `generate`; with `stream=True` it returns an async iterator."""
        if stream:
            check_stream_args(prompt, sampling_params, input_ids, rid, options)
            return self._astream(prompt, sampling_params, input_ids, rid, options)
        fut = asyncio.run_coroutine_threadsafe(
            self._engine.generate(prompt, sampling_params, input_ids, rid, **options), self._loop
        )
        return await asyncio.wrap_future(fut)

    async def _astream(self, prompt: Any, sp: Any, input_ids: Any, rid: Any,
                       options: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        caller = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            caller.call_soon_threadsafe(q.put_nowait, item)

        fut = asyncio.run_coroutine_threadsafe(self._pump(put, prompt, sp, input_ids, rid, options), self._loop)
        try:
            while (item := await q.get()) is not _Done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not fut.done():
                self._loop.call_soon_threadsafe(fut.cancel)

    async def _pump(self, put: Any, prompt: Any, sp: Any, input_ids: Any, rid: Any, options: dict[str, Any]) -> None:
        """On the engine's loop: hand each chunk, then an error if any, then _Done to `put`
        (which crosses to the consuming thread or loop)."""
        try:
            async for chunk in self._engine.stream(prompt, sp, input_ids, rid, **options):
                put(chunk)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(e)
        finally:
            put(_Done)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """As AsyncEngine.abort: the request `rid`, or with abort_all=True every request."""
        self._run(self._engine.abort(rid, abort_all))

    # The control plane: each as the AsyncEngine method of the same name (docs/control.md).

    def pause_generation(self, mode: PauseMode = "abort", refuse_new: bool = False) -> dict[str, Any]:
        """Stop generating ("abort", "retract" or "in_place") until continue_generation."""
        return self._run(self._engine.pause_generation(mode, refuse_new))

    def continue_generation(self) -> dict[str, Any]:
        return self._run(self._engine.continue_generation())

    def abort_all(self) -> int:
        """Abort every request; returns how many ended."""
        return self._run(self._engine.abort_all())

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 flush_cache: bool = True, abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> dict[str, Any]:
        """Load new weights from a checkpoint; a refusal raises ValueError (old weights kept)."""
        return self._run(self._engine.update_weights_from_disk(
            model_path, load_format, flush_cache=flush_cache, abort_all_requests=abort_all_requests,
            weight_version=weight_version))

    def update_weights_from_tensor(self, named_tensors: Any, *, load_format: str | None = None,
                                   flush_cache: bool = True, abort_all_requests: bool = False,
                                   weight_version: str | None = None) -> dict[str, Any]:
        """Load (name, tensor) pairs, a dict of them, or a SharedTensors; nothing is pickled."""
        return self._run(self._engine.update_weights_from_tensor(
            named_tensors, load_format=load_format, flush_cache=flush_cache, abort_all_requests=abort_all_requests,
            weight_version=weight_version))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> dict[str, Any]:
        """Join a trainer's torch.distributed group (the trainer is rank 0)."""
        return self._run(self._engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                                world_size, group_name, backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        abort_all_requests: bool = False,
                                        weight_version: str | None = None) -> dict[str, Any]:
        """Receive the named tensors from rank 0's broadcasts in the group, in order."""
        return self._run(self._engine.update_weights_from_distributed(
            names, dtypes, shapes, group_name=group_name, flush_cache=flush_cache,
            abort_all_requests=abort_all_requests, weight_version=weight_version))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return self._run(self._engine.destroy_weights_update_group(group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of a parameter, flattened."""
        return self._run(self._engine.get_weights_by_name(name, truncate_size))

    def release_memory_occupation(self, tags: list[MemoryTag] | None = None) -> dict[str, Any]:
        """Free the weights' and/or the KV cache's device memory (None: both)."""
        return self._run(self._engine.release_memory_occupation(tags))

    def resume_memory_occupation(self, tags: list[MemoryTag] | None = None) -> dict[str, Any]:
        return self._run(self._engine.resume_memory_occupation(tags))

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load a LoRA adapter under `lora_name` (requests name it as lora_path); a refusal raises ValueError."""
        return self._run(self._engine.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload the adapter `lora_name`; refused (ValueError) while live requests use it."""
        return self._run(self._engine.unload_lora_adapter(lora_name))

    def get_weight_version(self) -> str:
        return self._run(self._engine.get_weight_version())

    def flush_cache(self) -> dict[str, Any]:
        return self._run(self._engine.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return self._run(self._engine.get_server_info())

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self._run(self._engine.aclose())
        finally:
            self._closed = True
            self._stop_loop()
            atexit.unregister(self.shutdown)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
