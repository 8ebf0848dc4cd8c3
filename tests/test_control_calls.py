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


@pytest.mark.anyio
async def test_tokenizer_calls_match_replies_name_errors_and_fail_on_death() -> None:
    """The remote tokenizer's calls: answered by req_id in any order, a refusal raised as a
    ValueError naming the caller's field, concurrent vocabulary fetches sharing one call,
    and every pending call (and every later one) failed once the engine is dead."""
    from sgl.core.protocol import TokenizerCall, TokenizerCallOutput
    from sgl.runtime.tokenizer_client import RemoteTokenizer, load_vocab
    from sgl.runtime.tokenizer_manager import EngineDeadError

    send, recv, tok_send = ListSender(), AsyncQueueReceiver(), ListSender()
    tok = RemoteTokenizer(tok_send, has_chat_template=False)
    tm = TokenizerManager(tok, send, recv, LIMITS)
    try:
        a = asyncio.ensure_future(tm.tokenize("first", None))
        b = asyncio.ensure_future(tm.tokenize("second", None))
        await wait_sent(tok_send, 2)
        ca, cb = tok_send.msgs
        assert isinstance(ca, TokenizerCall) and ca.texts == ["first"] and ca.req_id != cb.req_id  # type: ignore[attr-defined]
        recv.q.put_nowait(TokenizerCallOutput(ids=[[2, 2]], req_id=cb.req_id))  # type: ignore[attr-defined]
        recv.q.put_nowait(TokenizerCallOutput(ids=[[1]], req_id=ca.req_id))
        assert await a == [1] and await b == [2, 2]
        bad = asyncio.ensure_future(tm.tokenize("x", None))
        await wait_sent(tok_send, 3)
        recv.q.put_nowait(TokenizerCallOutput(error="TypeError: no", req_id=tok_send.msgs[2].req_id))  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="^prompt: the tokenizer rejected it"):
            await bad
        vocabs = [asyncio.ensure_future(load_vocab(tok, 3)) for _ in range(5)]
        await wait_sent(tok_send, 4)
        await asyncio.sleep(0.01)
        assert len(tok_send.msgs) == 4  # one fetch for all five
        recv.q.put_nowait(TokenizerCallOutput(texts=["a", "b", "c"], req_id=tok_send.msgs[3].req_id))  # type: ignore[attr-defined]
        assert [await v for v in vocabs] == [["a", "b", "c"]] * 5
        pending = asyncio.ensure_future(tm.tokenize("y", None))
        await wait_sent(tok_send, 5)
        tm._fail(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError, match="gone"):
            await pending
        with pytest.raises(EngineDeadError):
            await tm.tokenize("z", None)
        assert len(tok_send.msgs) == 5 and not tok.calls.pending
    finally:
        recv.close()
        await tm.close()
