"""`EngineFrontEnd`: what an engine offers its caller, the same whether it started
its own roles (`AsyncEngine`) or attached to a running engine's scheduler
(`AttachedEngine`): generate, stream, encode (embeddings), abort, the control calls (flush_cache,
get_server_info, health), the control plane with SGLang's names (pause and continue,
abort all, weight updates and versions, memory release and resume: docs/control.md),
LoRA adapters (loading, unloading, the adapter a request names: docs/lora.md),
liveness, and closing (`aclose`, `async with`).

Requests go to its tokenizer manager, which runs on the caller's loop; the front
end holds no request state of its own. What it knows of the loaded adapters is its
`LoraAdapters`' (sgl/engine/lora_adapters.py), for a fast check of a request's adapter.
How an engine stops is its own (`_stop`: the roles shut down, or only this client's
route detached)."""

from __future__ import annotations

import asyncio
import atexit
import functools
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeVar

from sgl.core.log import get_logger
from sgl.core.lora_rules import is_name
from sgl.core.protocol import AbortAllReq, ContinueGenerationReq, MemoryTag, Message, PauseMode, SharedTensors
from sgl.core.server_args import ModelFiles, ServerArgs
from sgl.engine import control_args as ca
from sgl.engine.batch_args import (
    batch_options,
    index_offsets,
    item_call,
    item_stream,
    one_request,
    options_of,
    split_batch,
)
from sgl.engine.lora_adapters import LoraAdapters
from sgl.runtime.embeddings import Embeddings
from sgl.runtime.launch import off_loop
from sgl.runtime.metrics import Metrics
from sgl.runtime.req_options import ReqOptions
from sgl.runtime.streams import gather_calls, merge_streams
from sgl.runtime.tokenizer_manager import EngineDeadError, TokenizerManager

E = TypeVar("E", bound="EngineFrontEnd")


class EngineFrontEnd(ABC):
    def __init__(self, args: ServerArgs, files: ModelFiles, info: dict[str, Any], tm: TokenizerManager,
                 metrics: Metrics, loras: LoraAdapters | None = None) -> None:
        """`loras`: the adapters as far as this front end knows them; None: as `args` started them."""
        self.args = args
        self.files = files
        self.info = info  # the scheduler's server info when this engine began (its limits, its model)
        self.tm = tm
        self.metrics = metrics
        self.loras = loras if loras is not None else LoraAdapters.of_args(args)
        self.log = get_logger("engine")
        self._closed = False
        atexit.register(self.shutdown)

    @property
    def model_path(self) -> str:
        """The model's directory or .gguf file (the default model's directory when none was given)."""
        return self.files.model_path

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer, for the caller's own use (None under skip_tokenizer_init)."""

    # ---- generation ------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        **options: Any,
    ) -> dict[str, Any] | list[Any]:
        """One dict for one prompt; a list, in order, for a batch. With n > 1 a prompt
        gives a list of n dicts (a batch: one such list per prompt); with beam_width >= 1
        a list of its beams, best first, each meta_info with cumulative_logprob, score
        and beam_index (never streamed).

        Options (SGLang's request-level arguments; in a batch each may be a list, one
        per prompt): return_logprob, logprob_start_len, top_logprobs_num,
        token_ids_logprob, return_text_in_logprobs, custom_logit_processor, detokenize;
        priority (higher first under schedule_policy="priority") and timeout (seconds from
        the scheduler's receipt; past it the request ends with an abort naming the deadline);
        lora_path, the name of the LoRA adapter that runs it (None: the base model; an
        adapter not loaded is a ValueError before anything is sent).
        Logprobs are log_softmax of the model's raw logits (before logit_bias,
        penalties, processors and temperature), as SGLang returns by default."""
        items = split_batch(prompt, input_ids, sampling_params, rid)
        if items is None:
            p, ids, r = one_request(prompt, input_ids, rid)
            one = options_of(options)
            await self._check_adapters([one])
            return await self._one(p, ids, sampling_params, r, one)
        opts = batch_options(options, len(items))
        await self._check_adapters(opts)
        # One task group: a failed or cancelled prompt cancels its siblings (each sends its abort).
        return await gather_calls([item_call(i, functools.partial(self._one, *it, o))
                                   for i, (it, o) in enumerate(zip(items, opts))])

    async def _one(self, prompt: str | None, input_ids: list[int] | None, sp: Any, rid: str | None,
                   opts: ReqOptions) -> Any:
        self._check_open()
        gen = self.tm.generate(prompt, input_ids, sp, rid, stream=False, opts=opts)
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    async def stream(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        **options: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Delta chunks: each holds the new text, ids and logprobs; the last has a
        finish_reason. With n > 1 the samples' chunks interleave, each with its "index".
        A batch (arguments as for `generate`) interleaves the chunks of all its prompts,
        each with "index" = the prompt's position, or with n > 1 the count of samples
        of the prompts before it plus the sample's index (prompt_index * n + sample_index
        when every prompt has the same n). Leaving the loop early aborts every unfinished
        request. Options as for `generate`."""
        self._check_open()
        items = split_batch(prompt, input_ids, sampling_params, rid)
        if items is None:
            p, ids, r = one_request(prompt, input_ids, rid)
            one = options_of(options)
            await self._check_adapters([one])
            gen = self.tm.generate(p, ids, sampling_params, r, stream=True, opts=one)
        else:
            opts = batch_options(options, len(items))
            await self._check_adapters(opts)
            gen = self._stream_batch(items, opts)
        try:
            async for chunk in gen:
                yield chunk
        finally:
            await gen.aclose()

    def _stream_batch(self, items: list[tuple[Any, Any, Any, Any]],
                      opts: list[ReqOptions]) -> AsyncGenerator[dict[str, Any], None]:
        offsets = index_offsets([sp for _, _, sp, _ in items])
        gens = [item_stream(i, self.tm.generate(p, ids, sp, r, stream=True, opts=o))
                for i, ((p, ids, sp, r), o) in enumerate(zip(items, opts))]
        return merge_streams(gens, offsets)

    async def _check_adapters(self, opts: list[ReqOptions]) -> None:
        """Refuse a call whose requests name an adapter this engine does not serve
        (a ValueError naming lora_path), asking the scheduler once before refusing a
        name this front end does not know: another client may have loaded it."""
        names = self.loras.requested(o.lora_path for o in opts)
        await self._learn_adapters(names)
        self.loras.check(names, "lora_path")

    async def _learn_adapters(self, names: set[str]) -> None:
        if self.loras.lacks(names):
            self._check_open()
            self.loras.learn(await self.tm.server_info())

    # ---- embeddings --------------------------------------------------------------

    async def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        dimensions: int | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's encode: each prompt's embedding, {"embedding": [floats], "meta_info":
        {...}} for one prompt, a list of them, in order, for a batch. The model pools its
        prompt's final hidden states as its files say (last token or mean, normalised or
        not: docs/engine.md); `dimensions` truncates (and renormalises) a Matryoshka
        model's vectors. Raises ValueError, naming the field, for a model that serves no
        embeddings or invalid input."""
        self._check_open()
        emb = Embeddings(self.info.get("embedding"))
        emb.check(dimensions)
        items = split_batch(prompt, input_ids, None, rid)
        if items is None:
            return await self._encode(emb, *one_request(prompt, input_ids, rid), dimensions)
        return await gather_calls([item_call(i, functools.partial(self._encode, emb, p, ids, r, dimensions))
                                   for i, (p, ids, _, r) in enumerate(items)])

    async def _encode(self, emb: Embeddings, prompt: str | None, input_ids: list[int] | None, rid: str | None,
                      dimensions: int | None) -> dict[str, Any]:
        out = await self.tm.encode(prompt, input_ids, rid)
        return {"embedding": emb.shape(out["embedding"], dimensions).tolist(), "meta_info": out["meta_info"]}

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort the request `rid` (for n > 1, all its samples); SGLang's
        `abort_all=True` aborts every request instead (see `abort_all`)."""
        target = ca.abort_target(rid, abort_all)
        if target is None:
            await self.abort_all()
        else:
            self.tm.abort(target)

    async def flush_cache(self) -> dict[str, Any]:
        out = await self.tm.flush_cache()
        return {"success": out.success, "message": out.message}

    async def get_server_info(self) -> dict[str, Any]:
        return await self.tm.server_info()

    async def health(self) -> bool:
        return await self.tm.health()

    # ---- the control plane (docs/control.md) -------------------------------------

    async def _control(self, req: Message) -> dict[str, Any]:
        self._check_open()
        return ca.result(await self.tm.control_plane(req))

    async def pause_generation(self, mode: PauseMode = "abort", refuse_new: bool = False) -> dict[str, Any]:
        """Stop generating. mode "abort" ends running and waiting requests (reason abort);
        "retract" puts running ones back in the queue, their progress kept; "in_place"
        freezes them where they are. New requests wait for `continue_generation`, or
        with `refuse_new` end at once as busy (ServerBusyError)."""
        return await self._control(ca.pause(mode, refuse_new))

    async def continue_generation(self) -> dict[str, Any]:
        """Resume generating after `pause_generation`."""
        return await self._control(ContinueGenerationReq())

    async def abort_all(self) -> int:
        """Abort every request of the engine (every client's); returns how many ended."""
        return int((await self._control(AbortAllReq())).get("aborted", 0))

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                       flush_cache: bool = True, abort_all_requests: bool = False,
                                       weight_version: str | None = None) -> dict[str, Any]:
        """Load new weights of the same architecture from a checkpoint (a safetensors
        directory or a .gguf file). Waits until no request runs (abort_all_requests:
        abort them first); flush_cache drops the radix cache made by the old weights.
        Returns {"success", "message", "num_paused_requests", "weight_version"}; a
        refusal raises ValueError and leaves the old weights serving."""
        return await self._control(ca.from_disk(model_path, load_format, flush_cache, abort_all_requests,
                                                weight_version))

    async def update_weights_from_tensor(self, named_tensors: Any, *, load_format: str | None = None,
                                         flush_cache: bool = True, abort_all_requests: bool = False,
                                         weight_version: str | None = None) -> dict[str, Any]:
        """Load tensors by their Hugging Face names: a list of (name, tensor) pairs or a
        dict (packed into shared memory, or one CUDA IPC buffer, for the call and freed
        after it; nothing is pickled), or a SharedTensors you made with
        sgl.weights.share_tensors and keep open until this returns. Options as for
        `update_weights_from_disk`."""
        options = ca.tensor_options(load_format, flush_cache, abort_all_requests, weight_version)
        if isinstance(named_tensors, SharedTensors):
            return await self._control(ca.from_tensor(named_tensors, options))
        buf = await _shared(ca.named_items(named_tensors))
        try:
            return await self._control(ca.from_tensor(buf.spec, options))
        finally:
            buf.close()

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict[str, Any]:
        """Join a trainer's torch.distributed group (the trainer is rank 0; this engine's
        ranks are rank_offset + tp_rank) for `update_weights_from_distributed`. backend:
        "nccl" (GPUs) or "gloo" (CPU)."""
        return await self._control(ca.init_group(master_address, master_port, rank_offset, world_size, group_name,
                                                 backend))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              abort_all_requests: bool = False,
                                              weight_version: str | None = None) -> dict[str, Any]:
        """Receive each named tensor (Hugging Face names; dtypes as torch names without
        "torch.") from rank 0's broadcasts in the group, in this order. Options as for
        `update_weights_from_disk`."""
        return await self._control(ca.from_distributed(names, dtypes, shapes, group_name, flush_cache,
                                                       abort_all_requests, weight_version))

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        """Leave the group `init_weights_update_group` joined."""
        return await self._control(ca.destroy_group(group_name))

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of a parameter (its Hugging Face name), flattened."""
        return list((await self._control(ca.get_weights(name, truncate_size))).get("parameter", []))

    async def release_memory_occupation(self, tags: list[MemoryTag] | None = None) -> dict[str, Any]:
        """Free the device memory of the weights and/or the KV cache (tags: "weights",
        "kv_cache"; None: both), e.g. while a trainer on the same GPU runs. Pause first:
        nothing generates until `resume_memory_occupation`."""
        return await self._control(ca.release(tags))

    async def resume_memory_occupation(self, tags: list[MemoryTag] | None = None) -> dict[str, Any]:
        """Take back what `release_memory_occupation` freed (tags as there); released
        weights come back as they were unless an update loaded new ones."""
        return await self._control(ca.resume(tags))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load a LoRA adapter (a PEFT folder: adapter_config.json and its weights) under
        `lora_name`, which requests then give as lora_path (over HTTP also as the OpenAI
        `model`). Returns {"success", "message", "loaded_adapters": {name: path}}; the
        engine refuses (ValueError, nothing changed) a name in use, a rank above
        max_lora_rank, a module outside lora_target_modules, more than max_loaded_loras
        adapters, or an engine started without LoRA."""
        req = ca.load_lora(lora_name, lora_path)
        self.loras.check_enabled("lora_name")
        out = await self._control(req)
        self.loras.after(out, req.lora_name, req.lora_path)
        return out

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload the adapter `lora_name`; refused (ValueError) while live requests use it,
        and for a name not loaded. Returns as `load_lora_adapter`."""
        req = ca.unload_lora(lora_name)
        self.loras.check_enabled("lora_name")
        await self._learn_adapters({req.lora_name})
        self.loras.check({req.lora_name}, "lora_name")
        out = await self._control(req)
        self.loras.after(out, req.lora_name, None)
        return out

    async def lora_adapter_path(self, name: str) -> str | None:
        """The folder of the loaded adapter `name`; None when no adapter of that name is
        known to be loaded (the scheduler is asked once when this front end lacks it)."""
        if self.loras.enabled is False or not is_name(name):
            return None
        await self._learn_adapters({name})
        return self.loras.listed().get(name)

    async def get_weight_version(self) -> str:
        """The version of the weights serving now: "default" until an update sets one
        (each result's meta_info["weight_version"] names the weights that made it)."""
        version = (await self.get_server_info()).get("weight_version")
        if not isinstance(version, str):
            raise RuntimeError("the scheduler reports no weight_version")
        return version

    # ---- liveness ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine has been shut down")

    def dead_reason(self) -> str | None:
        """Why this engine can no longer serve (shut down, its requests failed), or None
        while it can. Answered here, without asking the scheduler: a liveness check
        that a busy forward does not delay."""
        if self._closed:
            return "the engine has been shut down"
        if self.tm.dead is not None:
            return str(self.tm.dead)
        return None

    @property
    def open_requests(self) -> int:
        """Requests (samples) of this engine still waiting for their outputs."""
        return len(self.tm.states)

    def end_open_requests(self, message: str) -> None:
        """End every open request with a RuntimeError(`message`), which its caller
        sees (a 503 over HTTP, an error event on a stream); each is aborted in the
        scheduler. Later requests still run: this is no death."""
        self.tm.fail_requests(message)

    # ---- closing -----------------------------------------------------------------

    @abstractmethod
    def _stop(self) -> None:
        """Blocking, once: end what this engine holds beyond its channels (its roles, or
        its route at the scheduler)."""

    def shutdown(self) -> None:
        """Stop and free every resource; safe to call twice, from any thread, and at exit."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop()
        finally:
            self.tm.close_channels(EngineDeadError("the engine was shut down"))
            atexit.unregister(self.shutdown)

    async def aclose(self) -> None:
        """Shut down without blocking the loop: the blocking part (waiting for the roles
        to exit, up to 10 s) runs on a thread."""
        await self.tm.close()
        await off_loop(self.shutdown)

    async def __aenter__(self: E) -> E:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _shared(items: list[tuple[str, Any]]) -> Any:
    """sgl.weights.share_tensors(items) off the loop (packing copies every tensor); a
    caller cancelled meanwhile still has the buffer closed once it is made."""
    from sgl.transports.tensors import share_tensors  # torch stays unimported until here

    made = asyncio.ensure_future(off_loop(share_tensors, items))
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        made.add_done_callback(lambda f: None if f.cancelled() or f.exception() else f.result().close())
        raise
