"""The detokenizer's output router splits a batch by client without losing a column."""

from __future__ import annotations

from sgl.core.protocol import BatchStrOutput, Logprobs, Message
from sgl.runtime.output_router import OutputRouter
from sgl.transports.channel import Sender


class _Collect(Sender):
    def __init__(self) -> None:
        self.got: list[Message] = []

    def send(self, msg: Message) -> None:
        self.got.append(msg)

    def close(self) -> None:
        pass


def test_split_keeps_every_column_per_client() -> None:
    local, remote = _Collect(), _Collect()
    router = OutputRouter(local, None)
    router.routes["c1"] = remote
    lp = Logprobs(output_vals=[-0.5])
    b = BatchStrOutput(["a", "c1:b", "c"], ["x", "y", "z"], [[1], [2], [3]],
                       [None, {"type": "length", "length": 1}, None],
                       [4, 5, 6], [1, 1, 1], [0, 2, 0], [None, lp, None])
    router.send(b)
    assert remote.got == [
        BatchStrOutput(["c1:b"], ["y"], [[2]], [{"type": "length", "length": 1}], [5], [1], [2], [lp])
    ]
    assert local.got == [BatchStrOutput(["a", "c"], ["x", "z"], [[1], [3]], [None, None], [4, 6], [1, 1], [0, 0],
                                        [None, None])]
