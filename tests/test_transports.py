"""The codec and the three channel implementations, over real sockets for ZMQ."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from sgl.core.protocol import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReqOutput,
    HealthCheckReq,
    Logprobs,
    ShutdownReq,
)
from sgl.core.sampling_params import SamplingParams
from sgl.transports.codec import Codec, DecodeError
from sgl.transports.factory import make_addresses, open_receiver, open_sender

MESSAGES = [
    GenerateReqInput("r1", [1, 2, 3], SamplingParams(temperature=0.5, top_k=3, stop_token_ids=[7]), stream=True),
    GenerateReqInput("r2", [1], SamplingParams(stop=["\n"], logit_bias={3: -1.5}, custom_params={"k": [1]}),
                     return_logprob=True, logprob_start_len=0, top_logprobs_num=2, token_ids_logprob=[4],
                     custom_logit_processor="force_tokens", detokenize=False, prefix_leader="r1"),
    AbortReq("r1"),
    BatchTokenIDOutput(["a", "b"], [[1], []], [None, {"type": "length", "length": 4}], [3, 4], [1, 4], [0, 2],
                       [True, False], [True, True], [False, True], [["x"], []], [True, False],
                       [Logprobs([-0.5], [[-0.5, -1.0]], [[1, 2]], [], [0, 1], [None, -2.0]), None]),
    BatchStrOutput(["a"], ["h\u00e9llo \U0001f600"], [[5, 6]], [{"type": "stop", "matched": 2}], [1], [2], [0],
                   [None]),
    FlushCacheReqOutput(False, "busy"),
    GetServerInfoReqOutput({"kv_free": 10, "nested": {"x": [1.5]}}),
    HealthCheckReq(),
    ShutdownReq(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_codec_round_trip(msg: object) -> None:
    c = Codec()
    assert c.decode(c.encode(msg)) == msg


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xff\xfe garbage",
        msgspec.msgpack.encode({"type": "no_such_tag"}),
        msgspec.msgpack.encode({"type": "abort"}),  # missing rid
        msgspec.msgpack.encode({"type": "abort", "rid": 5}),  # wrong type
        msgspec.msgpack.encode({"type": "abort", "rid": "x", "extra": 1}),  # unknown field
        msgspec.msgpack.encode({"type": "generate", "rid": "x", "input_ids": [1], "sampling_params": {"top_p": 2.0}}),
        msgspec.msgpack.encode([1, 2, 3]),
    ],
)
def test_codec_rejects_bad_frames(frame: bytes) -> None:
    with pytest.raises(DecodeError):
        Codec().decode(frame)


@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
def test_channel_delivers_in_order_and_survives_malformed_frames(transport: str) -> None:
    addrs = make_addresses(transport)
    recv = open_receiver(addrs.to_scheduler)
    send = open_sender(addrs.to_scheduler)
    try:
        send.send(MESSAGES[0])
        send.send_raw(b"not msgpack at all")  # type: ignore[attr-defined]
        send.send_raw(msgspec.msgpack.encode({"type": "unknown"}))  # type: ignore[attr-defined]
        for m in MESSAGES[1:]:
            send.send(m)
        got = [recv.recv(timeout=5) for _ in MESSAGES]
        assert got == MESSAGES
        assert recv.recv(timeout=0.05) is None
    finally:
        send.close()
        recv.close()
        if addrs.ipc_dir:
            import shutil

            shutil.rmtree(addrs.ipc_dir)


@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
def test_channel_async_receive(transport: str) -> None:
    addrs = make_addresses(transport)
    recv = open_receiver(addrs.to_tokenizer)
    send = open_sender(addrs.to_tokenizer)

    async def main() -> list[object]:
        async def later() -> None:
            await asyncio.sleep(0.05)
            for i in range(20):
                send.send(AbortReq(f"r{i}"))

        task = asyncio.create_task(later())
        out = [await asyncio.wait_for(recv.recv_async(), 5) for _ in range(20)]
        await task
        return out

    try:
        assert asyncio.run(main()) == [AbortReq(f"r{i}") for i in range(20)]
    finally:
        send.close()
        recv.close()


def test_inproc_receiver_woken_from_another_thread() -> None:
    import threading

    addrs = make_addresses("inproc")
    recv = open_receiver(addrs.to_scheduler)
    send = open_sender(addrs.to_scheduler)

    async def main() -> object:
        threading.Timer(0.05, lambda: send.send(ShutdownReq())).start()
        return await asyncio.wait_for(recv.recv_async(), 5)

    assert asyncio.run(main()) == ShutdownReq()
    recv.close()
