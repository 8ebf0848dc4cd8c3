"""A stand-in RL trainer for tests/test_weights.py, run in its own (spawned) process:
it shares one layer's noise-added tensors through sgl.weights.share_tensors and keeps
the buffer open until told to close it, and broadcasts another layer's over a
weight-update group as rank 0. Commands and replies cross a pipe as msgpack bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch

from sgl.weights import SharedBuffer, init_update_group, share_tensors


def noisy_layer(model_dir: str, layer: int, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of one layer plus seeded noise (the same in every process)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{layer}."
    return {name: t + 0.05 * torch.randn(t.shape, generator=gen)
            for name, t in sorted(tensors.items()) if name.startswith(prefix)}


def trainer_main(model_dir: str, conn: Any) -> None:
    torch.set_num_threads(1)
    shared: SharedBuffer | None = None
    while True:
        cmd = msgspec.msgpack.decode(conn.recv_bytes())
        op = cmd["op"]
        if op == "share":
            shared = share_tensors(noisy_layer(model_dir, cmd["layer"], cmd["seed"]))
            conn.send_bytes(msgspec.msgpack.encode(shared.spec))
        elif op == "close":
            assert shared is not None
            shared.close()
            conn.send_bytes(b"closed")
        elif op == "broadcast":
            tensors = noisy_layer(model_dir, cmd["layer"], cmd["seed"])
            with init_update_group("127.0.0.1", cmd["port"], 0, 2, backend="gloo", timeout_s=60) as group:
                for t in tensors.values():
                    group.broadcast(t, src=0)
            conn.send_bytes(b"sent")
        else:
            conn.send_bytes(b"bye")
            return
