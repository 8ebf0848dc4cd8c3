"""`AsyncEngine`: the engine for code already inside an event loop, which starts its
own roles (the scheduler and the detokenizer: processes, or threads under inproc),
owns them, and shuts them down at exit. Its tokenizer manager runs on the caller's
loop. The caller's process loads no tokenizer: the detokenizer's process holds it
and does the manager's tokenizer work (sgl/runtime/tokenizer_client.py);
`tokenizer` loads a copy here only when the caller asks for it.

`AsyncEngine.connect` attaches to a running engine's scheduler instead: it gives an
AttachedEngine (sgl/engine/attached_engine.py), which owns no roles."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from sgl.core.protocol import ShutdownReq
from sgl.core.request_checks import limits_of
from sgl.core.server_args import ServerArgs
from sgl.engine.attached_engine import AttachedEngine
from sgl.engine.front_end import EngineFrontEnd
from sgl.runtime.engine_roles import EngineRoles, find_model_files
from sgl.runtime.launch import RoleHandle, Watchdog, off_loop
from sgl.runtime.metrics import Metrics
from sgl.runtime.tokenizer_client import RemoteTokenizer
from sgl.runtime.tokenizer_manager import EngineDeadError, TokenizerManager
from sgl.sched.models.tokenizer import load_tokenizer

__all__ = ["AsyncEngine", "EngineDeadError"]

ROLES_EXIT_S = 10.0  # how long a shutdown waits for the roles to exit before killing them


def _import_front_end_modules() -> None:
    """The modules the front end first imports while it is built on the loop
    (prometheus_client for its metrics, anyio's asyncio backend for its locks), imported
    on a thread by `start` instead: tens of milliseconds the loop would stall."""
    for name in ("prometheus_client", "anyio._backends._asyncio"):
        importlib.import_module(name)


class AsyncEngine(EngineFrontEnd):
    """`async with await AsyncEngine.start(model_path) as e: out = await e.generate("Hi")`.

    Two ways to start one, the same engine either way:

    - `await AsyncEngine.start(model_path, **server_args)` never blocks the loop: the
      model's files are found on a thread, the roles start (the tokenizer loads in the
      detokenizer's process), and their readiness reports are polled, so the loop's
      other tasks (a signal handler, a server) run meanwhile. Cancelling it kills the
      started child processes and removes the socket folder. `sgl serve` starts this way.
    - `AsyncEngine(model_path, **server_args)` blocks until the roles are ready
      (seconds: the model loads), and with it any loop it is called on: for scripts,
      tests, or before a loop runs.

    `aclose()` (or leaving `async with`) shuts it down: the roles stop."""

    # `await AsyncEngine.connect(scheduler_address, ...)`: an AttachedEngine (see there).
    connect = AttachedEngine.connect

    def __init__(self, model_path: str | None = None, *, roles: EngineRoles | None = None,
                 **server_args: Any) -> None:
        """Start the roles and wait until they are ready (blocking); `roles`: roles that
        are ready already (what `start` passes), then no other argument."""
        if roles is None:
            args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
            roles = EngineRoles(args, find_model_files(args))
            roles.wait_ready()
        elif model_path is not None or server_args:
            roles.abandon()
            raise TypeError("AsyncEngine(roles=...) takes no other argument: the roles started with theirs")
        self.roles = roles
        args = roles.args
        metrics = Metrics()
        tok = None if args.skip_tokenizer_init else RemoteTokenizer(roles.tokenizer_sender(), roles.has_chat_template)
        tm = TokenizerManager(tok, roles.scheduler_sender(), roles.recv,
                              limits_of(roles.scheduler_info, tok is not None, args.custom_logit_processors),
                              roles.files.model_path, metrics=metrics, control_timeout=args.control_timeout,
                              health_timeout=args.health_timeout)
        self._watchdog = Watchdog(roles.handles, args.watchdog_interval, self._on_role_death)
        super().__init__(args, roles.files, roles.scheduler_info, tm, metrics)
        self._watchdog.start()
        self.log.info("engine ready", model=self.model_path, transport=args.transport)

    @classmethod
    async def start(cls, model_path: str | None = None, **server_args: Any) -> AsyncEngine:
        """Start an engine without blocking the running loop; cancellable (see the class)."""
        args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        roles = EngineRoles(args, await off_loop(find_model_files, args))
        await roles.ready()
        await off_loop(_import_front_end_modules)
        return cls(roles=roles)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer, for the caller's own use (None under
        skip_tokenizer_init). Loaded in this process on first access, which blocks
        (and holds the GIL while tokenizers parses its file); the engine itself never
        uses it."""
        if self.tm.tok is None:
            return None
        return load_tokenizer(self.files.tokenizer_path, self.args.trust_remote_code, self.args.chat_template)

    def _on_role_death(self, handle: RoleHandle) -> None:
        err = EngineDeadError(
            f"the {handle.name} {handle.exit_description()}; every pending request failed. "
            "Check the log above for its error, then start a new engine."
        )
        self.log.error("role died", role=handle.name, how=handle.exit_description())
        self.tm.fail_all(err)
        self.roles.kill()  # the engine is unusable now: leave no orphan (and no zombie) behind

    def dead_reason(self) -> str | None:
        """Why this engine can no longer serve (shut down, a role gone, its requests
        failed), or None while it can; answered without asking the scheduler."""
        return super().dead_reason() or self.roles.death()

    def _stop(self) -> None:
        """The roles stop: a ShutdownReq through the scheduler, or killed when one is
        gone already (then the request would wait out the timeout)."""
        self._watchdog.stop()
        try:
            if self.roles.death() is not None:
                self.roles.kill()
            elif self.tm.dead is None:
                self.tm.send.send(ShutdownReq())
        finally:
            self.roles.wait_stopped(ROLES_EXIT_S)
