"""Entry point of a child role: `python -m sgl.runtime.child READY_FD`.

The config arrives as one JSON line on stdin; readiness or the startup error goes
back as one JSON line on the READY_FD pipe. Stdin then stays open: when it hits
end-of-file the parent is gone, and the child exits at once. A fresh interpreter,
never a fork, so the user's main module is never re-imported."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

import msgspec


def _exit_when_parent_dies() -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        os._exit(0)


def main() -> None:
    ready_fd = int(sys.argv[1])
    from sgl.core.log import configure
    from sgl.runtime.roles import ChildConfig, run_role

    cfg = msgspec.json.decode(sys.stdin.buffer.readline(), type=ChildConfig)
    configure(cfg.server_args.log_level)
    threading.Thread(target=_exit_when_parent_dies, name="parent-watch", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which shuts us down

    def report(status: dict[str, Any]) -> None:
        with os.fdopen(ready_fd, "w") as f:
            f.write(json.dumps(status) + "\n")

    try:
        run_role(cfg, report)
    except BaseException:  # noqa: BLE001 - any failure exits 1; already logged with its traceback by run_role
        os._exit(1)  # not a normal shutdown: the stdin watcher thread would abort it
    os._exit(0)


if __name__ == "__main__":
    main()
