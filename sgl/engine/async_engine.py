"""`AsyncEngine`: the engine for code already inside an event loop. Its tokenizer
manager runs on the caller's loop. It starts the scheduler and detokenizer roles
(processes, or threads under inproc) and shuts them down at exit. The caller's
process loads no tokenizer: the detokenizer's process holds it and does the
manager's tokenizer work (sgl/runtime/tokenizer_client.py); `tokenizer` loads a
copy here only when the caller asks for it.

`AsyncEngine.connect(scheduler_address, ...)` attaches to the scheduler of an
engine running in another process (tcp transport): it binds its own receive
socket, registers it with that engine's detokenizer, and stops nothing but its
own sockets when closed."""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import shutil
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from sgl.core.log import get_logger
from sgl.core.protocol import AttachReq, AttachReqOutput, DetachReq, ShutdownReq
from sgl.core.request_checks import RequestLimits, limits_of
from sgl.core.server_args import ServerArgs
from sgl.engine.batch_args import batch_options, index_offsets, one_request, options_of, split_batch
from sgl.engine.model_files import resolve_model_path
from sgl.runtime.dp_router import DataParallelSender
from sgl.runtime.identity import Security, attach_channels
from sgl.runtime.launch import (
    RoleHandle,
    Watchdog,
    abandon,
    await_ready,
    off_loop,
    spawn_roles,
    start_roles,
    wait_all,
)
from sgl.runtime.metrics import Metrics
from sgl.runtime.req_options import ReqOptions
from sgl.runtime.roles import ChildConfig, child_configs
from sgl.runtime.streams import gather_calls, merge_streams
from sgl.runtime.tokenizer_client import LocalTokenizer, RemoteTokenizer, Tokenizing
from sgl.runtime.tokenizer_manager import EngineDeadError, TokenizerManager
from sgl.runtime.tokenizer_ops import load_tokenizer
from sgl.transports.channel import ChannelFull, Receiver, Sender
from sgl.transports.factory import make_addresses, replica_addresses

__all__ = ["AsyncEngine", "EngineDeadError"]


class AsyncEngine:
    """`async with await AsyncEngine.start(model_path) as e: out = await e.generate("Hi")`.

    Two ways to start one, the same engine either way:

    - `await AsyncEngine.start(model_path, **server_args)` never blocks the loop: the
      model path is resolved on a thread, the roles start (the tokenizer loads in the
      detokenizer's process), and their readiness reports are polled, so the loop's
      other tasks (a signal handler, a server) run meanwhile. Cancelling it kills the started child
      processes and removes the socket folder. `sgl serve` starts this way.
    - `AsyncEngine(model_path, **server_args)` blocks until the roles are ready
      (seconds: the model loads), and with it any loop it is called on: for scripts,
      tests, or before a loop runs.

    `aclose()` (or leaving `async with`) shuts it down."""

    _heartbeat: asyncio.Future[None] | None = None  # an attached engine's health checks
    _tokenizer: Any = None  # the caller's own copy, loaded by `tokenizer`

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self._configure(model_path, kwargs)
        self.model_path = resolve_model_path(self.args)
        self.addresses = make_addresses(self.args.transport, self.args.host)
        self.replicas = replica_addresses(self.addresses, self.args.dp_size, self.args.host)
        recv = self.security.receiver(self.addresses.to_tokenizer, "tokenizer")
        try:
            roles, infos = start_roles(self._configs(), in_threads=self.args.transport == "inproc")
        except BaseException:
            recv.close()
            self._remove_ipc_dir()
            raise
        self._finish(roles, infos, recv)

    @classmethod
    async def start(cls, model_path: str | None = None, **kwargs: Any) -> AsyncEngine:
        """Start an engine without blocking the running loop; cancellable (see the class)."""
        self = cls.__new__(cls)
        self._configure(model_path, kwargs)
        self.model_path = await off_loop(resolve_model_path, self.args)
        self.addresses = make_addresses(self.args.transport, self.args.host)
        self.replicas = replica_addresses(self.addresses, self.args.dp_size, self.args.host)
        recv = self.security.receiver(self.addresses.to_tokenizer, "tokenizer")
        roles: list[RoleHandle] = []
        try:
            roles = spawn_roles(self._configs(), in_threads=self.args.transport == "inproc")
            infos = await await_ready(roles)
        except BaseException:  # a startup error, or cancelled (Ctrl-C): leave nothing behind
            abandon(roles)
            recv.close()
            self._remove_ipc_dir()
            raise
        self._finish(roles, infos, recv)
        return self

    def _configure(self, model_path: str | None, kwargs: dict[str, Any]) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        # tcp: CURVE keys (transport_keys, or made for this engine) or the shared key; the children get them.
        self.security = Security.of(self.args)
        self.log = get_logger("engine")
        self._closed = False
        self._attached = False
        self._roles: list[RoleHandle] = []
        self.metrics = Metrics()

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer, for the caller's own use (None under
        skip_tokenizer_init). Loaded in this process on first access, which blocks
        (and holds the GIL while tokenizers parses its file); the engine itself never
        uses it."""
        if self._tokenizer is None and self.tm.tok is not None:
            if isinstance(self.tm.tok, LocalTokenizer):
                self._tokenizer = self.tm.tok.tokenizer
            else:
                self._tokenizer = load_tokenizer(self.args.tokenizer_path or self.model_path,
                                                  self.args.trust_remote_code, self.args.chat_template)
        return self._tokenizer

    def _configs(self) -> list[ChildConfig]:
        return child_configs(self.args, self.model_path, self.replicas, self.addresses, self.security)

    def _scheduler_sender(self) -> Sender:
        """To the scheduler, or behind data parallelism to the router over the replicas."""
        senders = [self.security.sender(a.to_scheduler) for a in self.replicas]
        return senders[0] if len(senders) == 1 else DataParallelSender(senders)

    def _finish(self, roles: list[RoleHandle], infos: dict[str, dict[str, Any]], recv: Receiver) -> None:
        self._roles = roles
        self.info = infos["scheduler"]
        tok: Tokenizing | None = None
        if not self.args.skip_tokenizer_init:
            tok = RemoteTokenizer(self.security.sender(self.addresses.to_detokenizer),
                                  infos["detokenizer"]["chat_template"])
        self.tm = TokenizerManager(tok, self._scheduler_sender(), recv,
                                   limits_of(self.info, tok is not None, self.args.custom_logit_processors),
                                   self.model_path, metrics=self.metrics, control_timeout=self.args.control_timeout,
                                   health_timeout=self.args.health_timeout)
        self._watchdog = Watchdog(self._roles, self.args.watchdog_interval, self._on_role_death)
        self._watchdog.start()
        atexit.register(self.shutdown)
        self.log.info("engine ready", model=self.model_path, transport=self.args.transport)

    @classmethod
    async def connect(
        cls,
        scheduler_address: str,
        transport_key: str | None = None,
        tokenizer_path: str | None = None,
        skip_tokenizer_init: bool = False,
        host: str = "127.0.0.1",
        timeout: float = 3.0,
        heartbeat_interval: float = 1.0,
        keys: str | None = None,
        server_key: str | None = None,
    ) -> AsyncEngine:
        """Attach to the scheduler of a running engine (`sgl serve --transport tcp`).

        Under CURVE (the server runs with `--transport-keys DIR`), `keys` is this
        client's NAME.key_secret (its public key in the server's DIR/allowed/) and
        `server_key` the server's DIR/server.key (or its z85 text); the client id is
        the key's. Else `transport_key` is that engine's shared key (hex;
        `SGL_TRANSPORT_KEY` if None).
        Outputs come back to a socket bound on `host` at a free port. A health
        check every `heartbeat_interval` seconds stands in for the watchdog: a
        scheduler silent for `timeout` seconds fails every pending request with
        EngineDeadError, so a server that goes away is noticed within
        heartbeat_interval + timeout (4 s by default). Reconnecting is explicit: call
        `connect` again."""
        key = transport_key if transport_key is not None else os.environ.get("SGL_TRANSPORT_KEY")
        if not scheduler_address.startswith("tcp://"):
            raise ValueError(f"scheduler_address={scheduler_address!r} is invalid: must be a tcp:// address")
        self = cls.__new__(cls)
        self.args = ServerArgs.from_kwargs(transport="tcp", host=host, transport_key=key,
                                           skip_tokenizer_init=skip_tokenizer_init)
        self.log = get_logger("engine")
        self._closed = False
        self._attached = True
        self._roles = []
        self._watchdog = Watchdog([], 1.0, lambda h: None)
        self.metrics = Metrics()
        self.addresses = make_addresses("inproc")  # unused: no roles of our own
        send, recv, client_id = attach_channels(scheduler_address, host, key, keys, server_key)
        # Limits unknown until the scheduler answers; requests wait for that anyway.
        self.tm = TokenizerManager(None, send, recv, RequestLimits(0, 0, 0, False),
                                   client_id=client_id, metrics=self.metrics)
        try:
            await asyncio.wait_for(self.tm.control_call(AttachReq(client_id, recv.address), AttachReqOutput), timeout)  # type: ignore[attr-defined]
            self.info = await asyncio.wait_for(self.tm.server_info(), timeout)
        except (TimeoutError, asyncio.TimeoutError, ChannelFull):  # ChannelFull: no connection took it
            await self.tm.close()
            self.tm.send.close()
            self.tm.recv.close()
            raise ConnectionError(f"no scheduler answered at {scheduler_address} within {timeout}s "
                                  "(is it running with the tcp transport, and are the transport_key or keys right, "
                                  "this client's public key in its allowed/ folder?)") from None
        self.model_path = self.info["model_path"] or resolve_model_path(self.args)
        if not skip_tokenizer_init:  # no roles of its own: a tokenizer in this process, loaded off the loop
            self.tm.use_tokenizer(LocalTokenizer(await off_loop(load_tokenizer, tokenizer_path or self.model_path,
                                                                False, None)))
        # The scheduler's allow-list is not reported: an attached client sends no custom processors.
        self.tm.limits = limits_of(self.info, self.tm.tok is not None, None)
        self._heartbeat = asyncio.ensure_future(self._beat(scheduler_address, heartbeat_interval, timeout))
        atexit.register(self.shutdown)
        return self

    async def _beat(self, address: str, interval: float, timeout: float) -> None:
        while self.tm.dead is None:
            await asyncio.sleep(interval)
            try:
                await asyncio.wait_for(self.tm.health(), timeout)
            except (TimeoutError, asyncio.TimeoutError, ChannelFull):  # ChannelFull: no connection took it
                self.log.error("attached scheduler stopped answering", address=address)
                self.tm.fail_all(EngineDeadError(
                    f"the scheduler at {address} did not answer a health check within {timeout}s; "
                    "every pending request failed"))
            except EngineDeadError:
                return

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
        token_ids_logprob, return_text_in_logprobs, custom_logit_processor, detokenize.
        Logprobs are log_softmax of the model's raw logits (before logit_bias,
        penalties, processors and temperature), as SGLang returns by default."""
        items = split_batch(prompt, input_ids, sampling_params, rid)
        if items is None:
            p, ids, r = one_request(prompt, input_ids, rid)
            return await self._one(p, ids, sampling_params, r, options_of(options))
        opts = batch_options(options, len(items))
        # One task group: a failed or cancelled prompt cancels its siblings (each sends its abort).
        return await gather_calls([functools.partial(self._one, *it, o) for it, o in zip(items, opts)])

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
            gen = self.tm.generate(p, ids, sampling_params, r, stream=True, opts=options_of(options))
        else:
            gen = self._stream_batch(items, batch_options(options, len(items)))
        try:
            async for chunk in gen:
                yield chunk
        finally:
            await gen.aclose()

    def _stream_batch(self, items: list[tuple[Any, Any, Any, Any]],
                      opts: list[ReqOptions]) -> AsyncGenerator[dict[str, Any], None]:
        offsets = index_offsets([sp for _, _, sp, _ in items])
        gens = [self.tm.generate(p, ids, sp, r, stream=True, opts=o) for (p, ids, sp, r), o in zip(items, opts)]
        return merge_streams(gens, offsets)

    async def abort(self, rid: str) -> None:
        self.tm.abort(rid)

    async def flush_cache(self) -> dict[str, Any]:
        out = await self.tm.flush_cache()
        return {"success": out.success, "message": out.message}

    async def get_server_info(self) -> dict[str, Any]:
        return await self.tm.server_info()

    async def health(self) -> bool:
        return await self.tm.health()

    # ---- lifecycle -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine has been shut down")

    def _on_role_death(self, handle: RoleHandle) -> None:
        err = EngineDeadError(
            f"the {handle.name} {handle.exit_description()}; every pending request failed. "
            "Check the log above for its error, then start a new engine."
        )
        self.log.error("role died", role=handle.name, how=handle.exit_description())
        self.tm.fail_all(err)
        for h in self._roles:  # the engine is unusable now: leave no orphan (and no zombie) behind
            if h is not handle:
                h.kill()

    def dead_reason(self) -> str | None:
        """Why this engine can no longer serve (shut down, a role gone, its requests
        failed), or None while it can. Answered here, without asking the scheduler:
        a liveness check that a busy forward does not delay."""
        if self._closed:
            return "the engine has been shut down"
        if self.tm.dead is not None:
            return str(self.tm.dead)
        for h in self._roles:
            if not h.alive():
                return f"the {h.name} {h.exit_description()}"
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

    def _remove_ipc_dir(self) -> None:
        if self.addresses.ipc_dir:
            shutil.rmtree(self.addresses.ipc_dir, ignore_errors=True)

    def shutdown(self) -> None:
        """Stop the roles and free every resource; safe to call twice and at exit."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.stop()
        try:
            if any(not h.alive() for h in self._roles):  # died before the watchdog looked: no clean stop
                for h in self._roles:  # (the ShutdownReq goes through the scheduler; it would wait out the timeout)
                    h.kill()
            elif self.tm.dead is None:
                # An attached engine leaves the scheduler running: it only stops its route.
                self.tm.send.send(DetachReq(self.tm.client_id) if self._attached else ShutdownReq())
        finally:
            wait_all(self._roles, timeout=10)
            self.tm.fail_all(EngineDeadError("the engine was shut down"))
            self.tm.send.close()
            self.tm.recv.close()
            if self.tm.tok is not None:
                self.tm.tok.close()
            self._remove_ipc_dir()
            atexit.unregister(self.shutdown)

    async def aclose(self) -> None:
        """Shut down without blocking the loop: waiting for the roles to exit (up to 10 s)
        happens on a thread."""
        beat = self._heartbeat
        if beat is not None:
            beat.cancel()
        await self.tm.close()
        await off_loop(self.shutdown)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
