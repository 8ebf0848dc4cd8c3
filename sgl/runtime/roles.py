"""What a child role runs: build the scheduler or the detokenizer from a
ChildConfig, report readiness (or the startup error) once, then loop.

The same function runs in a child process (`python -m sgl.runtime.child`) and, for the
inproc transport, on a thread of the caller's process."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from sgl.core.log import get_logger
from sgl.core.server_args import ModelFiles, ServerArgs
from sgl.runtime.identity import Security
from sgl.transports.channel import Receiver, Sender
from sgl.transports.factory import Addresses, free_tcp_ports

Role = Literal["scheduler", "detokenizer"]


class ChildConfig(msgspec.Struct, frozen=True):
    role: Role
    server_args: ServerArgs
    files: ModelFiles
    addresses: Addresses
    # The engine's transport keys. None: from server_args (an ephemeral CURVE set must come from the engine).
    security: Security | None = None
    # Tensor parallelism: this scheduler's rank, and where its replica's ranks meet
    # (tcp://host:port); data parallelism: its replica (`addresses` are the replica's).
    tp_rank: int = 0
    dist_init: str | None = None
    dp_rank: int = 0

    @property
    def name(self) -> str:
        """The role's name for readiness and the watchdog, e.g. scheduler-dp1-tp1."""
        dp, tp = f"-dp{self.dp_rank}" if self.dp_rank else "", f"-tp{self.tp_rank}" if self.tp_rank else ""
        return self.role + dp + tp


def child_configs(args: ServerArgs, files: ModelFiles, replicas: list[Addresses], addresses: Addresses,
                  security: Security) -> list[ChildConfig]:
    """One scheduler per tensor-parallel rank of each data-parallel replica (replica 0's
    rank 0 first; each replica's ranks meet at an address of their own), then the detokenizer."""
    inits: list[str | None] = [None] * len(replicas)
    if args.tp_size > 1 and args.dist_init_addr:  # host:port, checked by ServerArgs
        host, _, port = args.dist_init_addr.rpartition(":")
        inits = [f"tcp://{host}:{int(port) + k}" for k in range(len(replicas))]
    elif args.tp_size > 1:  # ports picked together, so no two replicas get the same one
        inits = [f"tcp://127.0.0.1:{p}" for p in free_tcp_ports("127.0.0.1", len(replicas))]
    cfgs = []
    for dp, (addrs, dist_init) in enumerate(zip(replicas, inits)):
        cfgs += [ChildConfig("scheduler", args, files, addrs, security, tp_rank=rank, dist_init=dist_init,
                             dp_rank=dp) for rank in range(args.tp_size)]
    return [*cfgs, ChildConfig("detokenizer", args, files, addresses, security)]


# Roles of one process (the inproc transport's threads) import transformers' lazily
# loaded entry points one at a time: two threads resolving them at once can each see
# the other's half-initialized module ("cannot import name 'AutoTokenizer'").
_IMPORT_LOCK = threading.Lock()


def _import_shared() -> None:
    with _IMPORT_LOCK:
        import transformers

        _ = transformers.AutoConfig, transformers.AutoTokenizer


def run_role(cfg: ChildConfig, report: Callable[[dict[str, Any]], None], in_thread: bool = False) -> None:
    """Build the role, report {"status": "ready", "info": ...} or {"status": "error", ...}, then run."""
    log = get_logger(cfg.role)
    try:
        if in_thread:
            _import_shared()
        role = _build(cfg)
    except BaseException as e:  # noqa: BLE001 - any start-up error is reported to the parent, which raises it
        report({"status": "error", "type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()})
        return
    report({"status": "ready", "info": role.info() if hasattr(role, "info") else {}})
    try:
        role.run()
    except Exception:
        log.exception("role crashed")
        raise
    finally:
        if (close := getattr(role, "close", None)) is not None:
            close()  # its own threads (the scheduler's forward, mask and grammar threads)
        role.recv.close()
        role.send.close()


def _build(cfg: ChildConfig) -> Any:
    a, sec = cfg.addresses, cfg.security or Security.of(cfg.server_args)
    if cfg.role == "scheduler":
        from sgl.sched.scheduler import Scheduler

        args = cfg.server_args
        _take_gpu(cfg)
        if args.tp_size == 1:
            recv: Receiver = sec.receiver(a.to_scheduler, "scheduler")
            sched = Scheduler(args, cfg.files.model_path, recv, sec.sender(a.to_detokenizer))
        else:
            sched = _tp_scheduler(cfg, sec)
            recv = sched.recv
        recv.count_into(sched.stats)  # refused frames show in get_server_info as transport_refused*
        return sched
    from sgl.runtime.detokenizer import Detokenizer
    from sgl.runtime.output_router import OutputRouter
    from sgl.sched.models.tokenizer import load_tokenizer

    args = cfg.server_args
    tok = None if args.skip_tokenizer_init else load_tokenizer(cfg.files.tokenizer_path, args.trust_remote_code,
                                                               args.chat_template)
    recv = sec.receiver(a.to_detokenizer, "detokenizer")
    return Detokenizer(tok, recv, OutputRouter(sec.sender(a.to_tokenizer), sec.route, sec.identity_bound),
                       replies=lambda: sec.sender(a.to_tokenizer), threads=args.tokenizer_threads)


def _tp_scheduler(cfg: ChildConfig, sec: Security) -> Any:
    """One rank's scheduler: join the group (on GPU, rank r takes cuda:r), then only
    rank 0 connects to the other roles; the followers read what it reads."""
    from sgl.sched.models.parallel import init_tp
    from sgl.sched.runner.model_runner import resolve_device
    from sgl.sched.scheduler import Scheduler
    from sgl.sched.tp_channels import DropSender, FollowerReceiver, LeaderReceiver

    args, a = cfg.server_args, cfg.addresses
    assert cfg.dist_init is not None  # the engine gives every rank of a replica the same address
    tp = init_tp(cfg.tp_rank, args.tp_size, cfg.dist_init, resolve_device(args))
    if tp.is_leader:
        recv: Receiver = LeaderReceiver(sec.receiver(a.to_scheduler, "scheduler"), tp)
        send: Sender = sec.sender(a.to_detokenizer)
    else:
        recv, send = FollowerReceiver(tp), DropSender()
    return Scheduler(args, cfg.files.model_path, recv, send, tp=tp)


def _take_gpu(cfg: ChildConfig) -> None:
    """On GPU, rank r of replica k runs on cuda:(k x tp_size + r)."""
    from sgl.sched.runner.model_runner import resolve_device

    args = cfg.server_args
    need = args.tp_size * args.dp_size
    if need == 1 or resolve_device(args).type != "cuda":
        return
    import torch

    if torch.cuda.device_count() < need:
        raise ValueError(f"tp_size={args.tp_size} x dp_size={args.dp_size} needs {need} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    torch.cuda.set_device(cfg.dp_rank * args.tp_size + cfg.tp_rank)
