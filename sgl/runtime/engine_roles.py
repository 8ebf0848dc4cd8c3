"""An engine's own roles as one group, from their start to their stop: the model's
files found, the channels' addresses and transport keys, the schedulers and the
detokenizer spawned (processes, or threads under inproc), their readiness awaited,
and at the end their exit and the socket folder removed.

Finding the files and `wait_ready` block; `ready` polls on the caller's loop
without blocking it and is cancellable. A failed or cancelled start leaves
nothing behind. It sends no message to a role (the engine's tokenizer manager
does) and installs no signal handler."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Any

from sgl.core.server_args import ModelFiles, ServerArgs
from sgl.runtime.dp_router import DataParallelSender
from sgl.runtime.identity import Security
from sgl.runtime.launch import ProcessRole, RoleHandle, ThreadRole
from sgl.runtime.roles import child_configs
from sgl.sched.models.default_model import default_model_dir
from sgl.transports.channel import Sender
from sgl.transports.factory import make_addresses, replica_addresses

READY_POLL_S = 0.05


def find_model_files(args: ServerArgs) -> ModelFiles:
    """Where the engine's model and tokenizer are: `model_path`, which must exist, or
    the default model's directory (converted on first use). Blocking file work."""
    if args.model_path is None:
        return args.model_files(default_model_dir())
    if not os.path.exists(args.model_path):
        raise FileNotFoundError(
            f"model_path={args.model_path!r} does not exist: pass a Hugging Face model directory or a .gguf file"
        )
    return args.model_files(args.model_path)


class EngineRoles:
    def __init__(self, args: ServerArgs, files: ModelFiles) -> None:
        """Spawn every role without waiting for it (`wait_ready` or `ready` does)."""
        self.args = args
        self.files = files
        # tcp: CURVE keys (transport_keys, or made for this engine) or the shared key; the children get them.
        self.security = Security.of(args)
        self.addresses = make_addresses(args.transport, args.host)
        self.replicas = replica_addresses(self.addresses, args.dp_size, args.host)
        # The tokenizer manager's receiving end, bound before the roles that send to it
        # start; the engine hands it to its manager, which closes it.
        self.recv = self.security.receiver(self.addresses.to_tokenizer, "tokenizer")
        self.handles: list[RoleHandle] = []
        self.infos: dict[str, dict[str, Any]] = {}  # each ready role's report, by role name
        try:
            for cfg in child_configs(args, files, self.replicas, self.addresses, self.security):
                self.handles.append(ThreadRole(cfg) if args.transport == "inproc" else ProcessRole(cfg))
        except BaseException:
            self.abandon()
            raise

    # ---- start ------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Block until every role reported ready; a startup error is raised once
        nothing is left behind."""
        try:
            while not self._poll():
                time.sleep(READY_POLL_S)
        except BaseException:
            self.abandon()
            raise

    async def ready(self) -> None:
        """Until every role reported ready, polling without blocking the loop. A startup
        error, or a cancel (Ctrl-C), is raised once nothing is left behind."""
        try:
            while not self._poll():
                await asyncio.sleep(READY_POLL_S)
        except BaseException:
            self.abandon()
            raise

    def _poll(self) -> bool:
        """Every role not yet ready asked once, without blocking; whether all are. Raises
        the first startup error seen. Roles are asked together, never one awaited before
        the next: a role may wait on another that failed (tensor-parallel ranks meet in
        collectives, so one rank failing inside a CUDA graph's warm-up leaves the others
        in it), and only killing it ends that wait."""
        for h in self.handles:
            if h.name not in self.infos and (info := h.poll_ready()) is not None:
                self.infos[h.name] = info
        return len(self.infos) == len(self.handles)

    @property
    def scheduler_info(self) -> dict[str, Any]:
        """The first scheduler's report (its server info), once ready."""
        return self.infos["scheduler"]

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (the detokenizer's report), once ready."""
        return bool(self.infos["detokenizer"]["chat_template"])

    def abandon(self) -> None:
        """After a failed or cancelled start: kill and reap the processes at once (a thread
        cannot be killed: it is asked to stop, and as a daemon it ends with the process at
        the latest), close the receiving end and remove the socket folder."""
        for h in self.handles:
            h.kill()
            if not isinstance(h, ThreadRole):
                h.stop(1)
        self.recv.close()
        self.remove_ipc_dir()

    # ---- channels to the roles --------------------------------------------------

    def scheduler_sender(self) -> Sender:
        """To the scheduler, or behind data parallelism to the router over the replicas."""
        senders = [self.security.sender(a.to_scheduler) for a in self.replicas]
        return senders[0] if len(senders) == 1 else DataParallelSender(senders)

    def tokenizer_sender(self) -> Sender:
        """To the tokenizer's process (the detokenizer's), which does the caller's tokenizer work."""
        return self.security.sender(self.addresses.to_detokenizer)

    # ---- running and stopping ----------------------------------------------------

    def pids(self) -> dict[str, int]:
        """Each role process's id, by role name (none under inproc: the roles are threads)."""
        return {h.name: h.pid for h in self.handles if isinstance(h, ProcessRole)}

    def death(self) -> str | None:
        """How the first role that is gone went, or None while all run."""
        for h in self.handles:
            if not h.alive():
                return f"the {h.name} {h.exit_description()}"
        return None

    def kill(self) -> None:
        """Kill and reap every role (a thread is asked to stop): once one died the engine is
        unusable, and a clean stop would wait on the dead one."""
        for h in self.handles:
            h.kill()

    def wait_stopped(self, timeout: float) -> None:
        """Wait up to `timeout` seconds in all for the roles to exit (forcing those that
        do not), then remove the socket folder."""
        deadline = time.monotonic() + timeout
        for h in self.handles:
            h.stop(max(0.1, deadline - time.monotonic()))
        self.remove_ipc_dir()

    def remove_ipc_dir(self) -> None:
        if self.addresses.ipc_dir:
            shutil.rmtree(self.addresses.ipc_dir, ignore_errors=True)
