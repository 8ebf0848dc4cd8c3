"""The detokenizer's output router splits a batch by client without losing a column."""

from __future__ import annotations

from sgl.core.protocol import BatchStrOutput, Logprobs, Message
from sgl.runtime.output_router import OutputRouter
from sgl.transports.channel import Sender
from tests.fake_channels import ListSender


def test_split_keeps_every_column_per_client() -> None:
    local, remote = ListSender(), ListSender()
    router = OutputRouter(local, None)
    router.routes["c1"] = remote
    lp = Logprobs(output_vals=[-0.5])
    b = BatchStrOutput(["a", "c1:b", "c"], ["x", "y", "z"], [[1], [2], [3]],
                       [None, {"type": "length", "length": 1}, None],
                       [4, 5, 6], [1, 1, 1], [0, 2, 0], [None, lp, None])
    router.send(b)
    assert remote.msgs == [
        BatchStrOutput(["c1:b"], ["y"], [[2]], [{"type": "length", "length": 1}], [5], [1], [2], [lp])
    ]
    assert local.msgs == [BatchStrOutput(["a", "c"], ["x", "z"], [[1], [3]], [None, None], [4, 6], [1, 1], [0, 0],
                                        [None, None])]


def test_a_client_that_stops_reading_is_dropped_and_never_stalls_the_others() -> None:
    """Over real tcp sockets: an attached client whose socket is bound but never read
    fills its bounded queue; the router detaches it (instead of blocking the
    detokenizer) and every other client's outputs still arrive."""
    import time

    import zmq

    from sgl.core.protocol import AttachReq, AttachReqOutput
    from sgl.transports.zmq_channel import HWM_FRAMES

    ctx = zmq.Context.instance()
    stalled = ctx.socket(zmq.PULL)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.LINGER, 0)
    port = stalled.bind_to_random_port("tcp://127.0.0.1")
    local = ListSender()
    router = OutputRouter(local, None)
    router.send(AttachReq("slow", f"tcp://127.0.0.1:{port}"))
    assert "slow" in router.routes
    assert isinstance(msgspec_decode(stalled.recv()), AttachReqOutput)  # the attach went through
    b = BatchStrOutput(["slow:r", "mine"], ["x", "y"], [[1], [2]], [None, None], [1, 1], [1, 1], [0, 0], [None, None])
    start = time.monotonic()
    sent = 0
    while "slow" in router.routes and sent < 10 * HWM_FRAMES:
        router.send(b)
        sent += 1
    assert "slow" not in router.routes, f"still attached after {sent} batches"
    assert time.monotonic() - start < 30
    assert len(local.msgs) == sent  # the local client got every one of its rows meanwhile
    router.send(b)  # after the drop, its rows go nowhere and nothing blocks
    assert len(local.msgs) == sent + 1
    router.close()
    stalled.close()


def msgspec_decode(frame: bytes) -> Message:
    from sgl.transports.codec import Codec

    return Codec().decode(frame)


def test_attach_is_refused_twice_without_key_identity_and_replaced_with_it() -> None:
    """Without keys (the shared-key mode) a second attach under an attached id is refused;
    where ids are bound to keys (CURVE: the scheduler let only its owner send it) it
    replaces the first route. A route the opener refuses (no allowed key has that id)
    is never made."""
    from sgl.core.protocol import AttachReq, AttachReqOutput, DetachReq

    opened: list[tuple[str, str]] = []
    routes: dict[str, ListSender] = {}

    def opener(client_id: str, address: str) -> Sender:
        if client_id == "unknown":
            raise ValueError("no allowed key has that id")
        opened.append((client_id, address))
        routes[address] = ListSender()
        return routes[address]

    for replace in (False, True):
        opened.clear()
        router = OutputRouter(ListSender(), opener, replace=replace)
        router.send(AttachReq("c1", "tcp://h:1"))
        router.send(AttachReq("c1", "tcp://h:2"))
        router.send(AttachReq("unknown", "tcp://h:3"))
        assert "unknown" not in router.routes
        if replace:
            assert opened == [("c1", "tcp://h:1"), ("c1", "tcp://h:2")] and router.routes["c1"] is routes["tcp://h:2"]
            assert routes["tcp://h:2"].msgs == [AttachReqOutput("c1", True)]
        else:
            assert opened == [("c1", "tcp://h:1")] and router.routes["c1"] is routes["tcp://h:1"]
        router.send(BatchStrOutput(["c1:x"], ["t"], [[1]], [None], [1], [1], [0], [None]))
        assert len(router.routes["c1"].msgs) == 2  # type: ignore[attr-defined]
        router.send(DetachReq("c1"))
        assert not router.routes
