"""Beam search at the front end: the limits a beam request must pass, the detokenizer's
beam path, the tokenizer manager's result shape (a list of beams, best first), and the
engine, native HTTP, sgl.Client and OpenAI routes, on the null model, fake channels,
or the detokenizer alone."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from typing import Any

import pytest

import sgl
from sgl.core.protocol import BatchStrOutput, BatchTokenIDOutput, Beam, GenerateReqInput
from sgl.core.request_checks import RequestLimits, limits_of, request_error
from sgl.core.sampling_params import SamplingParams
from sgl.runtime.detokenizer import Detokenizer
from sgl.runtime.req_options import ReqOptions
from sgl.runtime.tokenizer_manager import TokenizerManager
from sgl.server.openai_protocol import ChatRequest, CompletionRequest, sampling_dict
from tests.conftest import NULL_VOCAB
from tests.fake_channels import AsyncQueueReceiver, ListSender
from tests.serve_util import HTTP, ServerProc

BEAM_META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
             "cumulative_logprob", "score", "beam_index", "weight_version"}


# ---- request checks ----------------------------------------------------------------

LIMITS = RequestLimits(vocab_size=100, context_length=64, max_total_tokens=64, has_tokenizer=False,
                       max_running_requests=8)


def _error(ids: list[int], sp: dict[str, Any], limits: RequestLimits = LIMITS, return_logprob: bool = False) -> Any:
    return request_error(ids, SamplingParams.coerce(sp), -1, 0, None, None, limits, return_logprob)


def test_limits_of_reads_max_running_requests() -> None:
    info = {"vocab_size": 10, "context_length": 20, "max_total_tokens": 30, "max_running_requests": 7}
    assert limits_of(info, False, None).max_running_requests == 7


def test_request_checks_for_beams() -> None:
    assert _error([1, 2], {"beam_width": 8, "max_new_tokens": 7}) is None  # 2 + 8 * 7 = 58 <= 64
    assert _error([1, 2], {"beam_width": 9, "max_new_tokens": 1}).startswith(
        "beam_width=9 is invalid: each beam takes a request row")
    err = _error([1, 2, 3], {"beam_width": 4, "max_new_tokens": 16})  # 3 + 64 > 64
    assert err.startswith("beam_width=4 is invalid") and "KV cache, which holds 64" in err and "(3 too many)" in err
    assert _error([1], {"beam_width": 2, "max_new_tokens": 4, "constraint": {"sequences": [[5, 100]]}}) == \
        "constraint.sequences: ids must lie in [0, 100)"
    assert _error([1], {"beam_width": 2, "max_new_tokens": 4, "constraint": {"sequences": [[5, 99]]}}) is None
    assert _error([1], {"beam_width": 2, "max_new_tokens": 4}, return_logprob=True) == \
        "return_logprob: not supported with beam_width; each beam carries cumulative_logprob"
    # Without beams none of it applies: 3 + 16 fits, logprobs are fine.
    assert _error([1, 2, 3], {"max_new_tokens": 16}, return_logprob=True) is None


# ---- detokenizer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from sgl.sched.models.default_model import default_model_dir
    from sgl.sched.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir())


def _token_batch(rids: list[str], beams: list[list[Beam] | None], new_ids: list[list[int]] | None = None,
                 fins: list[Any] | None = None, skip: bool = True, no_trim: bool = False,
                 detokenize: bool = True) -> BatchTokenIDOutput:
    n = len(rids)
    return BatchTokenIDOutput(rids, new_ids or [[] for _ in rids], fins or [{"type": "length", "length": 2}] * n,
                              [3] * n, [2] * n, [0] * n, [skip] * n, [True] * n, [no_trim] * n, [[] for _ in rids],
                              [detokenize] * n, [None] * n, beams)


def _beams(tokenizer: Any) -> list[Beam]:
    eos = tokenizer.eos_token_id
    a = tokenizer.encode("Paris is the capital", add_special_tokens=False) + [eos]
    b = tokenizer.encode(" Lyon, café 😀", add_special_tokens=False)
    return [Beam(a, -1.5, -0.3, {"type": "stop", "matched": eos}), Beam(b, -4.0, -0.8, {"type": "length", "length": 5})]


def test_detokenizer_decodes_each_beam(tokenizer: Any) -> None:
    detok = Detokenizer(tokenizer, None, None)  # type: ignore[arg-type]
    beams = _beams(tokenizer)
    out = detok.process(_token_batch(["r"], [beams]))
    assert out.texts == [""] and out.new_ids == [[]]
    got = out.beams[0]
    assert got is not None and [g.text for g in got] == ["Paris is the capital", " Lyon, café 😀"]
    assert [(g.output_ids, g.cumulative_logprob, g.score, g.finish_reason) for g in got] == \
        [(b.output_ids, b.cumulative_logprob, b.score, b.finish_reason) for b in beams]
    assert detok.states == {}
    # The request's options: special tokens shown, the matched EOS kept with no_stop_trim.
    kept = detok.process(_token_batch(["r"], [beams], skip=False, no_trim=True)).beams[0]
    assert kept is not None and kept[0].text == tokenizer.decode(beams[0].output_ids, skip_special_tokens=False)
    assert kept[0].text.endswith(tokenizer.eos_token)
    trimmed = detok.process(_token_batch(["r"], [beams], skip=False)).beams[0]
    assert trimmed is not None and trimmed[0].text == "Paris is the capital"


def test_detokenizer_beams_without_decoding(tokenizer: Any) -> None:
    beams = _beams(tokenizer)
    for detok, flag in ((Detokenizer(tokenizer, None, None), False), (Detokenizer(None, None, None), True)):  # type: ignore[arg-type]
        got = detok.process(_token_batch(["r"], [beams], detokenize=flag)).beams[0]
        assert got is not None and [g.text for g in got] == ["", ""]
        assert [g.output_ids for g in got] == [b.output_ids for b in beams]


def test_detokenizer_mixed_batch_and_the_beams_column(tokenizer: Any) -> None:
    detok = Detokenizer(tokenizer, None, None)  # type: ignore[arg-type]
    ids = tokenizer.encode("Hello there, general Kenobi", add_special_tokens=False)
    half = len(ids) // 2
    first = detok.process(_token_batch(["s"], [], new_ids=[ids[:half]], fins=[None]))  # no beams column at all
    assert first.beams == [None]
    beams = _beams(tokenizer)
    second = detok.process(_token_batch(["s", "b"], [None, beams], new_ids=[ids[half:], []],
                                        fins=[{"type": "length", "length": len(ids)}, beams[0].finish_reason]))
    assert first.texts[0] + second.texts[0] == tokenizer.decode(ids, skip_special_tokens=True)
    assert second.texts[1] == "" and second.beams[0] is None
    assert second.beams[1] is not None and second.beams[1][0].text == "Paris is the capital"
    assert detok.states == {}


# ---- tokenizer manager, over fake channels -------------------------------------------


async def _first(gen: Any) -> Any:
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


async def _sent(send: ListSender, n: int) -> None:
    while len(send.msgs) < n:
        await asyncio.sleep(0)


@pytest.mark.anyio
async def test_tokenizer_manager_returns_the_beams_best_first() -> None:
    send, recv = ListSender(), AsyncQueueReceiver()
    tm = TokenizerManager(None, send, recv, LIMITS)
    try:
        sp = {"beam_width": 3, "num_return_beams": 2, "max_new_tokens": 4, "length_penalty": 0.5}
        task = asyncio.ensure_future(_first(tm.generate(None, [1, 2, 3], sp, "bq", False)))
        await _sent(send, 1)
        req = send.msgs[0]
        assert isinstance(req, GenerateReqInput) and req.rid == "bq" and not req.stream
        assert (req.sampling_params.beam_width, req.sampling_params.return_beams) == (3, 2)
        best = Beam([5, 6, 7], -1.0, -0.58, {"type": "stop", "matched": 7}, "x y")
        other = Beam([8], -2.0, -2.0, {"type": "length", "length": 1}, "z")
        recv.q.put_nowait(BatchStrOutput(["bq"], [""], [[]], [best.finish_reason], [3], [3], [1], [None],
                                         [[best, other]]))
        out = await task
        assert isinstance(out, list) and len(out) == 2
        for k, (o, b) in enumerate(zip(out, (best, other))):
            m = o["meta_info"]
            assert set(m) == BEAM_META and m["e2e_latency"] > 0
            assert (o["text"], o["output_ids"]) == (b.text, b.output_ids)
            assert (m["id"], m["prompt_tokens"], m["cached_tokens"]) == ("bq", 3, 1)
            assert (m["finish_reason"], m["completion_tokens"]) == (b.finish_reason, len(b.output_ids))
            assert (m["cumulative_logprob"], m["score"], m["beam_index"]) == (b.cumulative_logprob, b.score, k)
        assert not tm.states
        # Aborted before a beam finished: still a list, the abort as beam 0.
        sp = {"beam_width": 2, "max_new_tokens": 4}
        task = asyncio.ensure_future(_first(tm.generate(None, [1], sp, "ab", False)))
        await _sent(send, 2)
        fin = {"type": "abort", "message": "aborted"}
        recv.q.put_nowait(BatchStrOutput(["ab"], [""], [[]], [fin], [1], [0], [0], [None], [None]))
        (only,) = await task
        assert only["output_ids"] == [] and only["meta_info"]["finish_reason"] == fin
        assert (only["meta_info"]["beam_index"], only["meta_info"]["cumulative_logprob"]) == (0, None)
    finally:
        recv.close()
        await tm.close()


@pytest.mark.anyio
async def test_tokenizer_manager_refuses_streamed_or_logprob_beams() -> None:
    send, recv = ListSender(), AsyncQueueReceiver()
    tm = TokenizerManager(None, send, recv, LIMITS)
    sp = {"beam_width": 2, "max_new_tokens": 4}
    with pytest.raises(ValueError, match=r"^stream=True is invalid with beam_width"):
        await _first(tm.generate(None, [1], sp, None, True))
    with pytest.raises(ValueError, match=r"^return_logprob: not supported with beam_width"):
        await _first(tm.generate(None, [1], sp, None, False, ReqOptions(return_logprob=True)))
    assert send.msgs == [] and not tm.states


# ---- the engines, on the null model --------------------------------------------------


@pytest.fixture(scope="module")
def engine(null_model_dir: str) -> Iterator[sgl.Engine]:
    e = sgl.Engine(null_model_dir, transport="inproc", load_format="null", skip_tokenizer_init=True,
                   max_total_tokens=600, max_running_requests=16)
    yield e
    e.shutdown()


BEAM = {"beam_width": 3, "max_new_tokens": 5}


def test_engine_refuses_what_beams_cannot_do(engine: sgl.Engine) -> None:
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        ({"beam_width": 17, "max_new_tokens": 2}, {}, r"^beam_width=17 is invalid: .*max_running_requests=16"),
        ({"beam_width": 8, "max_new_tokens": 80}, {}, r"^beam_width=8 is invalid: .*KV cache, which holds 600"),
        ({**BEAM, "constraint": {"sequences": [[1, NULL_VOCAB]]}}, {}, r"^constraint.sequences: ids must lie in"),
        (BEAM, {"return_logprob": True}, r"^return_logprob: not supported with beam_width"),
        ({**BEAM, "n": 2}, {}, r"sampling_params.n=2 is invalid"),
    ]
    for sp, opts, says in cases:
        with pytest.raises(ValueError, match=says):
            engine.generate(input_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], sampling_params=sp, **opts)
    assert engine.get_server_info()["running"] == 0


def test_engine_refuses_a_beam_stream(engine: sgl.Engine) -> None:
    with pytest.raises(ValueError, match=r"^stream=True is invalid with beam_width"):
        engine.generate(input_ids=[5, 6], sampling_params=BEAM, stream=True)  # at the call, not at next()
    with pytest.raises(ValueError, match=r"^stream=True"):
        engine.generate(input_ids=[[5, 6], [7]], sampling_params=[{"max_new_tokens": 2}, BEAM], stream=True)

    async def stream_one(e: sgl.AsyncEngine) -> None:
        async for _ in e.stream(input_ids=[5, 6], sampling_params=BEAM):
            pass

    with pytest.raises(ValueError, match=r"^stream=True"):
        engine._run(stream_one(engine._engine))


def test_engine_beam_result_is_a_list(engine: sgl.Engine) -> None:
    """A beam request gives a list of result dicts (a batch: one per prompt), whatever
    the scheduler does with it; with its beam support the list holds the beams."""
    out = engine.generate(input_ids=[5, 6], sampling_params=BEAM, rid="beam-1")
    assert isinstance(out, list) and out and out[0]["meta_info"]["beam_index"] == 0
    assert set(out[0]["meta_info"]) == BEAM_META and out[0]["meta_info"]["id"] == "beam-1"
    outs = engine.generate(input_ids=[[5, 6], [7]], sampling_params=[BEAM, {"max_new_tokens": 2}])
    assert isinstance(outs[0], list) and isinstance(outs[1], dict)


def _check_beams(beams: list[dict[str, Any]], k: int, prompt_len: int) -> None:
    assert len(beams) == k
    assert [b["meta_info"]["beam_index"] for b in beams] == list(range(k))
    scores = [b["meta_info"]["score"] for b in beams]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(b["output_ids"]) for b in beams}) == k  # distinct continuations
    for b in beams:
        m = b["meta_info"]
        assert set(m) == BEAM_META and m["prompt_tokens"] == prompt_len
        assert m["completion_tokens"] == len(b["output_ids"]) and m["finish_reason"] is not None


def test_engine_returns_the_beams(engine: sgl.Engine) -> None:
    out = engine.generate(input_ids=[5, 6], sampling_params=BEAM)
    _check_beams(out, 3, 2)
    two = engine.generate(input_ids=[5, 6], sampling_params={**BEAM, "num_return_beams": 2})
    _check_beams(two, 2, 2)
    assert [b["output_ids"] for b in two] == [b["output_ids"] for b in out[:2]]
    outs = engine.generate(input_ids=[[5, 6], [7, 8, 9]], sampling_params=BEAM)
    for o, n in zip(outs, (2, 3)):
        _check_beams(o, 3, n)
    assert all(b["text"] == "" for o in outs for b in o)  # no tokenizer: ids only


# ---- HTTP: native /generate, sgl.Client, OpenAI ----------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProc]:
    from sgl.sched.models.default_model import default_model_dir

    s = ServerProc("--model-path", default_model_dir(), "--load-format", "null", "--max-total-tokens", "4000",
                   "--served-model-name", "smol", "--log-level", "warning")
    yield s
    s.stop(signal.SIGTERM)


def test_openai_beam_fields_map_to_sampling_params() -> None:
    vllm = CompletionRequest(prompt="x", use_beam_search=True, n=4, length_penalty=0.7, early_stopping=True)
    assert sampling_dict(vllm, 8) == {"beam_width": 4, "num_return_beams": 4, "length_penalty": 0.7,
                                      "early_stopping": True, "max_new_tokens": 8}
    direct = ChatRequest(messages=[], beam_width=5, n=2, early_stopping="never")
    assert sampling_dict(direct, None) == {"beam_width": 5, "num_return_beams": 2, "early_stopping": "never"}
    assert sampling_dict(CompletionRequest(prompt="x", n=3), 8) == {"n": 3, "max_new_tokens": 8}


def test_http_refuses_what_beams_cannot_do(server: ServerProc) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/generate", {"text": "Hi", "sampling_params": BEAM, "stream": True}, "stream"),
        ("/generate", {"text": "Hi", "sampling_params": BEAM, "return_logprob": True}, "return_logprob"),
        ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 2, "stream": True}, "stream"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "beam_width": 2,
                                  "stream": True}, "stream"),
        ("/v1/completions", {"prompt": "Hi", "beam_width": 2, "n": 3}, "n"),
        ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 2, "temperature": 0.5}, "temperature"),
    ]
    for path, body, param in cases:
        r = server.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    with pytest.raises(ValueError, match=r"^stream=True"):
        asyncio.run(_client_stream(server.url))
    server.assert_balanced()


async def _client_stream(url: str) -> None:
    async with sgl.Client(url) as c:
        async for _ in c.stream("Hi", BEAM):
            pass


def test_http_beam_results_are_lists(server: ServerProc) -> None:
    r = server.post("/generate", json={"text": "Hi", "sampling_params": BEAM})
    assert r.status_code == 200 and isinstance(r.json(), list) and r.json()[0]["meta_info"]["beam_index"] == 0
    r = server.post("/generate", json={"text": ["Hi", "Yo"], "sampling_params": BEAM})
    assert [type(o) for o in r.json()] == [list, list]
    server.assert_balanced()


def test_http_returns_the_beams(server: ServerProc) -> None:
    r = server.post("/generate", json={"text": ["Hi", "Hello there"], "sampling_params": BEAM})
    assert r.status_code == 200
    per_prompt = r.json()
    for beams in per_prompt:
        _check_beams(beams, 3, beams[0]["meta_info"]["prompt_tokens"])
        assert all(isinstance(b["text"], str) for b in beams)

    async def client() -> Any:
        async with sgl.Client(server.url) as c:
            return await c.generate(["Hi", "Hello there"], BEAM)

    got = asyncio.run(client())
    assert [[b["output_ids"] for b in g] for g in got] == [[b["output_ids"] for b in g] for g in per_prompt]

    body = {"model": "smol", "prompt": ["Hi", "Hello there"], "max_tokens": 5, "use_beam_search": True, "n": 3}
    c = server.post("/v1/completions", json=body).json()
    assert [ch["index"] for ch in c["choices"]] == list(range(6))
    assert [ch["text"] for ch in c["choices"]] == [b["text"] for g in per_prompt for b in g]
    assert c["usage"]["completion_tokens"] == sum(b["meta_info"]["completion_tokens"] for g in per_prompt for b in g)
    assert c["usage"]["prompt_tokens"] == sum(g[0]["meta_info"]["prompt_tokens"] for g in per_prompt)

    chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "beam_width": 3,
            "n": 2}
    r2 = HTTP.post(server.url + "/v1/chat/completions", json=chat, timeout=30).json()
    assert [ch["index"] for ch in r2["choices"]] == [0, 1]
    assert all(ch["message"]["role"] == "assistant" for ch in r2["choices"])
    assert r2["usage"]["completion_tokens"] >= 2
    server.assert_balanced()
