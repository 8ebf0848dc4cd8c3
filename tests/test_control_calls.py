"""Control calls are matched to their replies by req_id and time out: a reply that
never comes fails only its own call, and replies arriving out of order still reach
the calls that asked for them. A fake channel pair stands in for the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sgl.core.protocol import GetServerInfoReq, GetServerInfoReqOutput, HealthCheckReq, Message
from sgl.core.request_checks import RequestLimits
from sgl.runtime.tokenizer_manager import TokenizerManager
from tests.fake_channels import AsyncQueueReceiver, ListSender

LIMITS = RequestLimits(vocab_size=100, context_length=64, max_total_tokens=64, has_tokenizer=False)
BACKENDS = [pytest.param("asyncio", id="asyncio")]
try:
    import uvloop  # noqa: F401

    BACKENDS.append(pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"))
except ImportError:
    pass


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def reply(req: Message, tag: str) -> GetServerInfoReqOutput:
    assert isinstance(req, GetServerInfoReq) and req.req_id
    return GetServerInfoReqOutput(info={"tag": tag}, req_id=req.req_id)


async def wait_sent(send: ListSender, n: int) -> None:
    while len(send.msgs) < n:
        await asyncio.sleep(0)


@pytest.mark.anyio
async def test_lost_reply_times_out_and_later_calls_get_their_own() -> None:
    send, recv = ListSender(), AsyncQueueReceiver()
    tm = TokenizerManager(None, send, recv, LIMITS, control_timeout=0.2, health_timeout=0.1)
    try:
        with pytest.raises(TimeoutError, match="GetServerInfoReq"):
            await tm.server_info()  # its reply never comes
        with pytest.raises(TimeoutError, match="HealthCheckReq"):
            await tm.health()
        assert isinstance(send.msgs[1], HealthCheckReq)
        a = asyncio.ensure_future(tm.server_info())
        b = asyncio.ensure_future(tm.server_info())
        await wait_sent(send, 4)
        req_a, req_b = send.msgs[2], send.msgs[3]
        recv.q.put_nowait(reply(send.msgs[0], "late"))  # the timed-out call's reply, dropped
        recv.q.put_nowait(reply(req_b, "b"))  # reverse order
        recv.q.put_nowait(reply(req_a, "a"))
        assert (await a)["tag"] == "a" and (await b)["tag"] == "b"
        assert not tm.control.pending
    finally:
        recv.close()
        await tm.close()


@pytest.mark.anyio
async def test_cancelled_call_forgets_its_future() -> None:
    send, recv = ListSender(), AsyncQueueReceiver()
    tm = TokenizerManager(None, send, recv, LIMITS)
    try:
        t = asyncio.ensure_future(tm.server_info())
        await wait_sent(send, 1)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert not tm.control.pending
        c = asyncio.ensure_future(tm.server_info())
        await wait_sent(send, 2)
        recv.q.put_nowait(reply(send.msgs[0], "stale"))
        recv.q.put_nowait(reply(send.msgs[1], "c"))
        assert (await c)["tag"] == "c"
    finally:
        recv.close()
        await tm.close()


def test_server_args_set_the_control_timeouts(null_model_dir: str) -> None:
    import sgl

    with pytest.raises(ValueError, match="control_timeout"):
        sgl.ServerArgs(model_path=null_model_dir, control_timeout=0)
    with sgl.Engine(null_model_dir, transport="inproc", load_format="null", skip_tokenizer_init=True,
                    control_timeout=1.5, health_timeout=0.5) as e:
        tm = e._engine.tm
        assert (tm.control.timeout, tm.health_timeout) == (1.5, 0.5)
        assert e.get_server_info()["running"] == 0
