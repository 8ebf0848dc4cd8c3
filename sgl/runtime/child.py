"""Entry point of a child role: `python -m sgl.runtime.child READY_FD`.

The config arrives as one JSON line on stdin; readiness or the startup error goes
back as one JSON line on the READY_FD pipe. Stdin then stays open: when it hits
end-of-file the parent is gone, and the child exits at once. A fresh interpreter,
never a fork, so the user's main module is never re-imported.

The parent's end of stdin closes however the parent ends (SIGTERM's default
action, SIGKILL, a crash, os._exit), and the parent closes it itself only after
the child has exited. So a child that sees end-of-file also removes the engine's
private ipc socket folder, which the parent had no chance to remove: the library
installs no signal handler of its own to do it in the parent (handlers are
process-wide, can only be set from the main thread, would replace the
application's own, and no handler runs on SIGKILL anyway)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import sys
import threading
from typing import Any

import msgspec

FLUSH_S = 2.0  # the most a normal exit waits for queued frames to leave
SWITCH_INTERVAL_S = 0.0002  # the GIL's turns in a child whose threads hand work to its loop (see main)


def _exit_when_parent_dies(ipc_dir: str | None) -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        if ipc_dir is not None and _is_private_ipc_dir(ipc_dir):
            shutil.rmtree(ipc_dir, ignore_errors=True)
        os._exit(0)


def _is_private_ipc_dir(path: str | None) -> bool:
    """Only a folder shaped like the ones `make_addresses` creates (`/.../sgl-*`) is removed."""
    return path is not None and os.path.isabs(path) and os.path.basename(os.path.normpath(path)).startswith("sgl-")


def _exit_flushed(code: int) -> None:
    """os._exit skips terminating the ZMQ context, and that termination is what lets
    queued frames out (each socket's linger): the scheduler's last send, the
    ShutdownReq it relays to the detokenizer, would be lost and the detokenizer left
    waiting until the parent's stop timeout. Terminate it first, within FLUSH_S
    (it would wait forever on a socket left open)."""
    zmq = sys.modules.get("zmq")
    if zmq is not None:
        t = threading.Thread(target=zmq.Context.instance().term, name="zmq-flush", daemon=True)
        t.start()
        t.join(FLUSH_S)
    os._exit(code)


def freeze_startup_heap() -> None:
    """Move everything allocated so far (modules, the model, graphs, tokenizers) out of the
    garbage collector's reach. None of it is ever garbage, yet each collection of the
    oldest generation walked all of it: a 55-77 ms pause of the process, a stall of every
    stream it serves. Only in processes sgl owns (its children, `sgl serve`), never in a
    caller's."""
    gc.collect()
    gc.freeze()


def single_threaded_host_ops() -> None:
    """One intra-op thread for torch's host ops, unless OMP_NUM_THREADS says otherwise.

    A GPU scheduler's host tensors are small (a batch's metadata), yet some CPU ops
    split work of any size over every core (repeat_interleave, for one), and the
    parallel region ends only when each thread has had its turn. On a busy host
    (clients, the server's other processes) one descheduled thread held a decode
    step's preparation for 10-30 ms, at each new request: W8 at 16 requests/s, ITL
    p99 19.0 ms with the default threads against 4.6 ms with one. vLLM's workers
    make the same choice. Only in a process of sgl's own: under the inproc
    transport the roles share the caller's process, whose settings are its own."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(1)


def gpu_scheduler_process(device: str = "auto") -> None:
    """What a scheduler's process sets for itself when it drives a GPU (`device`, as
    ServerArgs.device names it): the short GIL switch interval (see main) and one intra-op
    thread; nothing on a CPU. Benchmarks that run the scheduler in their own process and
    time its host work call it too, to time what a served engine runs."""
    if not _on_gpu(device):
        return
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    single_threaded_host_ops()


def _on_gpu(device: str) -> bool:
    if device not in ("auto", "cuda"):
        return False
    import torch

    return torch.cuda.is_available()


def main() -> None:
    ready_fd = int(sys.argv[1])
    from sgl.core.log import configure_logging
    from sgl.runtime.roles import ChildConfig, run_role

    cfg = msgspec.json.decode(sys.stdin.buffer.readline(), type=ChildConfig)
    configure_logging(cfg.server_args.log_level)  # a child of sgl's own: its stderr is the parent's
    threading.Thread(target=_exit_when_parent_dies, args=(cfg.addresses.ipc_dir,), name="parent-watch",
                     daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which shuts us down
    # Threads that run a few lines of Python between GIL-free native calls wait, at the
    # default 5 ms interval, up to that for the process's busy loop at each line: the
    # detokenizer's tokenizer threads (a prompt's encode took 12 ms p50 beside a busy loop,
    # 1.8 ms at this interval: benchmarks/tokenizer_turns.py) and a GPU scheduler's grammar
    # fill thread (sgl.sched.runner.grammar_masks). Not in a CPU scheduler, whose forward
    # runs on a thread of its own and would pay the turns.
    if cfg.role == "detokenizer":
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    elif cfg.role == "scheduler":
        gpu_scheduler_process(cfg.server_args.device)

    def report(status: dict[str, Any]) -> None:
        if status.get("status") == "ready":
            freeze_startup_heap()
        with os.fdopen(ready_fd, "w") as f:
            f.write(json.dumps(status) + "\n")

    try:
        run_role(cfg, report)
    except BaseException:  # noqa: BLE001 - any failure exits 1; already logged with its traceback by run_role
        os._exit(1)  # not a normal shutdown: the stdin watcher thread would abort it
    _exit_flushed(0)


if __name__ == "__main__":
    main()
