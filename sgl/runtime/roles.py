"""What a child role runs: build the scheduler or the detokenizer from a
ChildConfig, report readiness (or the startup error) once, then loop.

The same function runs in a child process (`python -m sgl.runtime.child`) and, for the
inproc transport, on a thread of the caller's process."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from sgl.core.log import get_logger
from sgl.core.server_args import ServerArgs
from sgl.runtime.identity import Security
from sgl.transports.factory import Addresses

Role = Literal["scheduler", "detokenizer"]


class ChildConfig(msgspec.Struct, frozen=True):
    role: Role
    server_args: ServerArgs
    model_path: str
    tokenizer_path: str | None
    addresses: Addresses
    # The engine's transport keys. None: from server_args (an ephemeral CURVE set must come from the engine).
    security: Security | None = None


def run_role(cfg: ChildConfig, report: Callable[[dict[str, Any]], None]) -> None:
    """Build the role, report {"status": "ready", "info": ...} or {"status": "error", ...}, then run."""
    log = get_logger(cfg.role)
    try:
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
        role.recv.close()
        role.send.close()


def _build(cfg: ChildConfig) -> Any:
    a, sec = cfg.addresses, cfg.security or Security.of(cfg.server_args)
    if cfg.role == "scheduler":
        from sgl.sched.scheduler import Scheduler

        recv = sec.receiver(a.to_scheduler, "scheduler")
        sched = Scheduler(cfg.server_args, cfg.model_path, recv, sec.sender(a.to_detokenizer))
        recv.count_into(sched.stats)  # refused frames show in get_server_info as transport_refused*
        return sched
    from sgl.runtime.detokenizer import Detokenizer
    from sgl.runtime.output_router import OutputRouter
    from sgl.sched.models.tokenizer import load_tokenizer

    tok = None if cfg.server_args.skip_tokenizer_init else load_tokenizer(cfg.tokenizer_path or cfg.model_path)
    recv = sec.receiver(a.to_detokenizer, "detokenizer")
    return Detokenizer(tok, recv, OutputRouter(sec.sender(a.to_tokenizer), sec.route, sec.identity_bound))
