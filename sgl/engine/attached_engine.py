"""`AttachedEngine`: an engine front end in this process over the scheduler of an
engine running in another (`sgl serve --transport tcp`), made by
`await AsyncEngine.connect(...)` (which is `AttachedEngine.connect`). It binds its
own receive socket, registers it with that engine's detokenizer, loads its own
tokenizer (off the loop: it has no tokenizer process to ask), and when closed stops
nothing but its own route and sockets. A heartbeat stands in for the watchdog of
an engine that owns its roles."""

from __future__ import annotations

import asyncio
import os
from typing import Any, TypeVar

from sgl.core.log import get_logger
from sgl.core.protocol import AttachReq, AttachReqOutput, DetachReq, GetServerInfoReq, GetServerInfoReqOutput
from sgl.core.request_checks import limits_of
from sgl.core.server_args import ModelFiles, ServerArgs
from sgl.engine.front_end import EngineFrontEnd
from sgl.engine.lora_adapters import LoraAdapters
from sgl.runtime.identity import attach_channels
from sgl.runtime.launch import off_loop
from sgl.runtime.metrics import Metrics
from sgl.runtime.tokenizer_client import LocalTokenizer
from sgl.runtime.tokenizer_manager import EngineDeadError, TokenizerManager
from sgl.sched.models.default_model import default_model_dir
from sgl.sched.models.tokenizer import load_tokenizer
from sgl.transports.channel import ChannelFull, Receiver, Sender

__all__ = ["AttachedEngine"]

T = TypeVar("T")


class Heartbeat:
    """A health check of the attached scheduler every `interval` seconds: one silent for
    `timeout` seconds fails every pending request (and every later one) with
    EngineDeadError. Runs on the loop it is made on, until `stop` or that death."""

    def __init__(self, tm: TokenizerManager, address: str, interval: float, timeout: float) -> None:
        self.tm = tm
        self.address = address
        self.interval = interval
        self.timeout = timeout
        self.log = get_logger("engine")
        self._task = asyncio.get_running_loop().create_task(self._beat())

    def stop(self) -> None:
        self._task.cancel()

    async def _beat(self) -> None:
        while self.tm.dead is None:
            await asyncio.sleep(self.interval)
            try:
                await asyncio.wait_for(self.tm.health(), self.timeout)
            except (TimeoutError, asyncio.TimeoutError, ChannelFull):  # ChannelFull: no connection took it
                self.log.error("attached scheduler stopped answering", address=self.address)
                self.tm.fail_all(EngineDeadError(
                    f"the scheduler at {self.address} did not answer a health check within {self.timeout}s; "
                    "every pending request failed"))
            except EngineDeadError:
                return


class AttachedEngine(EngineFrontEnd):
    """`async with await AsyncEngine.connect("tcp://host:port") as e: out = await e.generate("Hi")`."""

    def __init__(self, args: ServerArgs, files: ModelFiles, info: dict[str, Any], tm: TokenizerManager,
                 metrics: Metrics, heartbeat: Heartbeat) -> None:
        """An engine over the route `connect` registered (call that, on the loop it will
        serve): `heartbeat` runs since."""
        # Its args are this client's, not the server's: what the server serves is in its info.
        super().__init__(args, files, info, tm, metrics, LoraAdapters.of_info(info))
        self.heartbeat = heartbeat

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
    ) -> AttachedEngine:
        """Attach to the scheduler of a running engine (`sgl serve --transport tcp`).

        Under CURVE (the server runs with `--transport-keys DIR`), `keys` is this
        client's NAME.key_secret (its public key in the server's DIR/allowed/) and
        `server_key` the server's DIR/server.key (or its z85 text); the client id is
        the key's. Else `transport_key` is that engine's shared key (hex;
        `SGL_TRANSPORT_KEY` if None).
        Outputs come back to a socket bound on `host` at a free port. The tokenizer
        is `tokenizer_path`'s, else the server's model's (the default model's when it
        runs that). A health check every `heartbeat_interval` seconds stands in for the
        watchdog: a scheduler silent for `timeout` seconds fails every pending request
        with EngineDeadError, so a server that goes away is noticed within
        heartbeat_interval + timeout (4 s by default). Reconnecting is explicit: call
        `connect` again."""
        key = transport_key if transport_key is not None else os.environ.get("SGL_TRANSPORT_KEY")
        if not scheduler_address.startswith("tcp://"):
            raise ValueError(f"scheduler_address={scheduler_address!r} is invalid: must be a tcp:// address")
        args = ServerArgs.from_kwargs(transport="tcp", host=host, transport_key=key, tokenizer_path=tokenizer_path,
                                      skip_tokenizer_init=skip_tokenizer_init)
        send, recv, client_id = attach_channels(scheduler_address, host, key, keys, server_key)
        try:
            info = await _attach(send, recv, client_id, scheduler_address, timeout)
            files = args.model_files(info["model_path"] or await off_loop(default_model_dir))
            tok = None
            if not skip_tokenizer_init:
                tok = LocalTokenizer(await off_loop(load_tokenizer, files.tokenizer_path, args.trust_remote_code,
                                                    args.chat_template))
        except BaseException:
            send.close()
            recv.close()
            raise
        metrics = Metrics()
        # The scheduler's allow-list is not reported: an attached client sends no custom processors.
        tm = TokenizerManager(tok, send, recv, limits_of(info, tok is not None, None), client_id=client_id,
                              metrics=metrics)
        return cls(args, files, info, tm, metrics, Heartbeat(tm, scheduler_address, heartbeat_interval, timeout))

    @property
    def tokenizer(self) -> Any:
        """This client's Hugging Face tokenizer, the one its requests are tokenized with
        (None under skip_tokenizer_init)."""
        return self.tm.tok.tokenizer if isinstance(self.tm.tok, LocalTokenizer) else None

    def _stop(self) -> None:
        """The scheduler keeps running: only this client's route goes."""
        if self.tm.dead is None:
            self.tm.send.send(DetachReq(self.tm.client_id))

    async def aclose(self) -> None:
        self.heartbeat.stop()
        await super().aclose()


async def _attach(send: Sender, recv: Receiver, client_id: str, address: str, timeout: float) -> dict[str, Any]:
    """Register this client's route (an AttachReq), then ask for the scheduler's server
    info; ConnectionError when either answer takes more than `timeout` seconds."""
    try:
        send.send(AttachReq(client_id, recv.address))  # type: ignore[attr-defined]
        await asyncio.wait_for(_next_of(recv, AttachReqOutput), timeout)
        send.send(GetServerInfoReq(origin=client_id))
        reply = await asyncio.wait_for(_next_of(recv, GetServerInfoReqOutput), timeout)
    except (TimeoutError, asyncio.TimeoutError, ChannelFull):  # ChannelFull: no connection took it
        raise ConnectionError(f"no scheduler answered at {address} within {timeout}s "
                              "(is it running with the tcp transport, and are the transport_key or keys right, "
                              "this client's public key in its allowed/ folder?)") from None
    return reply.info


async def _next_of(recv: Receiver, reply_type: type[T]) -> T:
    """The next message of `reply_type`: a client not yet attached is sent nothing else."""
    while not isinstance(msg := await recv.recv_async(), reply_type):
        pass
    return msg
