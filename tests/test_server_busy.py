"""Past max_queued_requests the engine refuses new requests at once with
ServerBusyError (an HTTP 503), instead of queueing without bound; the requests it
took still complete exactly, and the KV accounting balances."""

from __future__ import annotations

import asyncio

import pytest

import sgl
from sgl.server.common import api_error_of
from tests.conftest import assert_kv_balanced, null_continuation


def test_a_full_queue_raises_server_busy_and_the_rest_complete(null_model_dir: str) -> None:
    params = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}

    async def main() -> tuple[list[object], dict[str, object]]:
        async with sgl.AsyncEngine(null_model_dir, transport="inproc", load_format="null", skip_tokenizer_init=True,
                                   max_total_tokens=512, max_running_requests=1, max_queued_requests=2) as e:
            outs = await asyncio.gather(*(e.generate(input_ids=[i + 1], sampling_params=params) for i in range(12)),
                                        return_exceptions=True)
            return outs, await e.get_server_info()

    outs, info = asyncio.run(main())
    busy = [o for o in outs if isinstance(o, sgl.ServerBusyError)]
    done = [(i, o) for i, o in enumerate(outs) if isinstance(o, dict)]
    assert busy and done, outs
    assert len(busy) + len(done) == 12
    assert all("max_queued_requests=2" in str(b) for b in busy)
    for i, o in done:
        assert o["output_ids"] == null_continuation(i + 1, 200)
    assert_kv_balanced(info)


def test_server_busy_is_a_503() -> None:
    err = api_error_of(sgl.ServerBusyError("server busy: 3 queued requests (max_queued_requests=3); retry later"))
    assert err.status == 503 and "retry later" in err.message
    with pytest.raises(AttributeError):
        _ = sgl.NoSuchThing  # type: ignore[attr-defined]
