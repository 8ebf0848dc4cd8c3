"""The scheduler on a real (tiny) model: prefix reuse through the radix cache,
chunked prefill, schedule policies, flush refusal, and a soak under memory
pressure with random aborts and streams that must end with exact outputs and no
leaked KV slot."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

import sgl
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from tests.conftest import ENGINE_VARIANTS, assert_kv_balanced, tiny_model_dir

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-sched"), "llama", vocab=512, seed=3)


@pytest.fixture(scope="module")
def reference(tiny_dir: str) -> Iterator[sgl.Engine]:
    """The plain path: no radix cache, no chunking, no overlap."""
    e = sgl.Engine(tiny_dir, transport="inproc", skip_tokenizer_init=True, disable_radix_cache=True,
                   disable_overlap_schedule=True, max_total_tokens=8192)
    yield e
    e.shutdown()


def _gen(e: sgl.Engine, ids: list[int], n: int) -> dict[str, Any]:
    return e.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": n})


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_shared_prefix_is_reused_and_output_unchanged(tiny_dir: str, reference: sgl.Engine, variant: Any) -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(1, 500) for _ in range(120)]
    a, b = prefix + [7, 8, 9], prefix + [10, 11]
    with sgl.Engine(tiny_dir, **variant, skip_tokenizer_init=True, max_total_tokens=4096) as e:
        out_a = _gen(e, a, 8)
        out_b = _gen(e, b, 8)
        assert out_a["meta_info"]["cached_tokens"] == 0
        assert out_b["meta_info"]["cached_tokens"] >= len(prefix) - 1
        # The whole prompt is cached now; a request matches at most len - 1 tokens.
        again = _gen(e, b, 8)
        assert again["meta_info"]["cached_tokens"] == len(b) - 1
        assert again["output_ids"] == out_b["output_ids"]
        assert_kv_balanced(e.get_server_info())
    assert out_a["output_ids"] == _gen(reference, a, 8)["output_ids"]
    assert out_b["output_ids"] == _gen(reference, b, 8)["output_ids"]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("radix", [True, False])
def test_chunked_prefill_and_policies_keep_outputs(
    tiny_dir: str, reference: sgl.Engine, policy: str, radix: bool
) -> None:
    rng = random.Random(2)
    base = [rng.randrange(1, 500) for _ in range(90)]
    prompts = [base[: 30 + 7 * i] + [rng.randrange(1, 500) for _ in range(i % 3)] for i in range(8)]
    expected = [_gen(reference, p, 6)["output_ids"] for p in prompts]
    with sgl.Engine(tiny_dir, transport="inproc", skip_tokenizer_init=True, chunked_prefill_size=16,
                    max_prefill_tokens=40, schedule_policy=policy, disable_radix_cache=not radix,
                    max_total_tokens=4096) as e:
        outs = e.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 6})
        assert [o["output_ids"] for o in outs] == expected
        assert_kv_balanced(e.get_server_info())


def test_flush_cache_is_refused_while_requests_run(null_model_dir: str) -> None:
    async def main() -> None:
        async with sgl.AsyncEngine(null_model_dir, transport="inproc", load_format="null", skip_tokenizer_init=True,
                                   max_total_tokens=2000) as e:
            stream = e.stream(input_ids=[1, 2], sampling_params={**GREEDY, "max_new_tokens": 300}, rid="long")
            await stream.__anext__()
            res = await e.flush_cache()
            assert res["success"] is False and "running" in res["message"]
            await e.abort("long")
            chunks = [c async for c in stream]
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert (await e.flush_cache())["success"] is True
            assert_kv_balanced(await e.get_server_info())

    asyncio.run(main())


def test_soak_eviction_retraction_aborts_streams(tiny_dir: str, reference: sgl.Engine) -> None:
    """~1000 requests over ipc with a KV pool far smaller than the load: every request
    ends (finished or aborted), finished outputs are exact, nothing leaks."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    suffixes = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    prompts = [p + s for p in prefixes for s in suffixes]
    max_new = 20
    expected = {tuple(p): _gen(reference, p, max_new)["output_ids"] for p in prompts}

    async def one(e: sgl.AsyncEngine, i: int) -> tuple[list[int], list[int], dict[str, Any]]:
        ids = prompts[rng.randrange(len(prompts))]
        n = rng.randint(1, max_new)
        params = {**GREEDY, "max_new_tokens": n}
        rid = f"soak-{i}"
        if rng.random() < 0.1:
            asyncio.get_running_loop().call_later(rng.random() * 0.5, lambda: asyncio.ensure_future(e.abort(rid)))
        if rng.random() < 0.3:
            got: list[int] = []
            meta: dict[str, Any] = {}
            async for c in e.stream(input_ids=ids, sampling_params=params, rid=rid):
                got += c["output_ids"]
                meta = c["meta_info"]
            return ids, got, meta
        out = await e.generate(input_ids=ids, sampling_params=params, rid=rid)
        return ids, out["output_ids"], out["meta_info"]

    async def main() -> list[tuple[list[int], list[int], dict[str, Any]]]:
        async with sgl.AsyncEngine(tiny_dir, transport="ipc", skip_tokenizer_init=True, max_total_tokens=300,
                                   max_running_requests=48, chunked_prefill_size=64,
                                   disable_overlap_schedule=False) as e:
            results = await asyncio.gather(*(one(e, i) for i in range(1000)))
            info = await e.get_server_info()
            assert_kv_balanced(info)
            assert info["retractions"] > 0, "the pool was meant to force retraction"
            assert info["cached_tokens"] >= 0
            return results

    results = asyncio.run(main())
    aborted = 0
    for ids, got, meta in results:
        fin = meta["finish_reason"]
        assert fin is not None
        ref = expected[tuple(ids)]
        if fin["type"] == "abort":
            aborted += 1
            assert got == ref[: len(got)]
        else:
            assert fin == {"type": "length", "length": len(got)}
            assert got == ref[: len(got)]
    assert aborted > 0


# ---- the overlap loop: a prefilled request decodes in the next step ----

class Launched(NamedTuple):
    """One batch the scheduler built, as _drive records it."""

    decode: bool  # a decode step (a mixed batch is not)
    rids: list[str]
    partial: list[bool]
    decode_from: int  # its first decode entry (len(rids) for a prefill)
    tokens: int


def _drive(model: str, reqs: list[tuple[str, list[int], int]], overlap: bool, stream: bool = False,
           arrive: list[int] | None = None, prepared: list[Any] | None = None,
           **kw: Any) -> tuple[dict[str, list[int]], list[Launched]]:
    """Each request's output ids and the batches in launch order. `arrive`: the turn each
    request is sent before (all before the first by default); `stream`: sent as streams;
    `prepared`: filled with (each batch as prepared, the request table then)."""
    from sgl.core.protocol import BatchTokenIDOutput, GenerateReqInput
    from sgl.sched.scheduler import Scheduler
    from tests.fake_channels import ListSender, QueueReceiver

    args = ServerArgs.from_kwargs(model_path=model, device="cpu", skip_tokenizer_init=True, random_seed=0,
                                  disable_overlap_schedule=not overlap, **kw)
    recv, send = QueueReceiver(), ListSender()
    s = Scheduler(args, model, recv, send)
    batches: list[Launched] = []
    schedule = s._schedule

    def recording() -> Any:
        b = schedule()
        if b is not None:
            batches.append(Launched(b.is_decode, [r.rid for r in b.reqs], list(b.partial), b.decode_start,
                                    b.num_tokens))
        return b

    s._schedule = recording  # type: ignore[method-assign]
    if prepared is not None:
        prepare = s.runner.prepare

        def keeping(batch: Any) -> Any:
            p = prepare(batch)
            prepared.append((p, s.runner.req_to_token_pool.mirror.clone()))
            return p

        s.runner.prepare = keeping  # type: ignore[method-assign]
    when = arrive or [0] * len(reqs)
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    for turn in range(200):
        for (rid, ids, n), t in zip(reqs, when):
            if t == turn:
                recv.q.append(GenerateReqInput(rid, ids, SamplingParams(temperature=0, max_new_tokens=n,
                                                                        ignore_eos=True), stream=stream))
        s.step()
        if s.idle and turn >= max(when):
            break
    assert s.idle
    s.close()
    for m in send.msgs:
        if isinstance(m, BatchTokenIDOutput):
            for rid, new in zip(m.rids, m.new_ids):
                out[rid] += new
    return out, batches


def test_overlap_decodes_a_prefilled_request_in_the_next_step(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under the overlap loop a request whose last prompt chunk was just launched is in
    the very next decode step, its input its prefill's token on the device: its second
    token comes one step after its first, as every later one does. Not before its last
    chunk; never a request that ends with its first token. Greedy outputs equal the
    loop without overlap."""
    model = tiny_model_dir(tmp_path_factory.mktemp("join"), "llama", vocab=128, seed=5)
    rng = random.Random(2)
    reqs = [("long", [rng.randrange(1, 120) for _ in range(90)], 5),
            ("short", [rng.randrange(1, 120) for _ in range(7)], 4),
            ("one", [rng.randrange(1, 120) for _ in range(9)], 1)]
    plain, _ = _drive(model, reqs, overlap=False, chunked_prefill_size=32, max_total_tokens=2048)
    out, batches = _drive(model, reqs, overlap=True, chunked_prefill_size=32, max_total_tokens=2048)
    assert out == plain and all(len(out[rid]) == n for rid, _, n in reqs)
    at_once = 0
    for rid in ("long", "short"):
        last = max(i for i, b in enumerate(batches)
                   if not b.decode and any(r == rid and not p for r, p in zip(b.rids, b.partial)))
        assert not any(b.decode and rid in b.rids for b in batches[:last])
        assert rid in next(b.rids for b in batches[last + 1:] if b.decode), batches
        at_once += batches[last + 1].decode  # no admission round came in between: the very next step
    assert at_once >= 1, batches
    assert not any(b.decode and "one" in b.rids for b in batches)


def test_a_stream_waits_out_one_prefill_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Prompts arriving one per turn while a stream decodes: each would take a forward of
    its own ahead of every decode step. A streamed request instead gets a decode step
    after each prefill forward (never two prefills in a row while it runs), with the
    overlap loop and without; requests that are not streamed keep admission first. The
    outputs are the same either way (greedy)."""
    model = tiny_model_dir(tmp_path_factory.mktemp("owed"), "llama", vocab=128, seed=7)
    rng = random.Random(5)
    reqs = [("s", [rng.randrange(1, 120) for _ in range(5)], 30)]
    reqs += [(f"p{i}", [rng.randrange(1, 120) for _ in range(8)], 3) for i in range(5)]
    arrive = [0, 3, 4, 5, 6, 7]

    def prefills_in_a_row(batches: list[Launched]) -> int:
        """The longest run of prefill batches launched while "s" was running."""
        first = next(i for i, b in enumerate(batches) if b.decode and "s" in b.rids)
        last = max(i for i, b in enumerate(batches) if b.decode and "s" in b.rids)
        run = best = 0
        for b in batches[first:last]:
            run = 0 if b.decode else run + 1
            best = max(best, run)
        return best

    ref = None
    for overlap in (False, True):
        out, streamed = _drive(model, reqs, overlap, stream=True, arrive=arrive)
        plain_out, plain = _drive(model, reqs, overlap, arrive=arrive)
        assert out == plain_out and (ref is None or out == ref)
        ref = out
        assert prefills_in_a_row(streamed) == 1, streamed
        assert prefills_in_a_row(plain) > 1, plain  # the case the rule is for does arise


def test_a_prefill_forward_steps_the_running_requests(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With enable_mixed_chunk each prefill forward also carries a decode
    step of the running requests: from its first token to its last, a stream is in every
    batch, where with separate forwards it waits out each chunk of another's prompt. The
    chunk leaves room for the decode rows. Greedy outputs are those of separate forwards,
    with the overlap loop and without."""
    model = tiny_model_dir(tmp_path_factory.mktemp("mixed"), "llama", vocab=128, seed=5)
    rng = random.Random(3)
    reqs = [("a", [rng.randrange(1, 120) for _ in range(6)], 12),
            ("b", [rng.randrange(1, 120) for _ in range(6)], 9),
            ("long", [rng.randrange(1, 120) for _ in range(100)], 4)]
    kw: dict[str, Any] = {"chunked_prefill_size": 32, "max_total_tokens": 2048}

    def gaps(batches: list[Launched], rid: str) -> int:
        """Batches launched between the one with the request's last prompt token and its
        last decode step that lack it."""
        first = next(i for i, b in enumerate(batches) if not b.decode and any(
            r == rid and not p for r, p in zip(b.rids[: b.decode_from], b.partial)))
        last = max(i for i, b in enumerate(batches) if rid in b.rids[b.decode_from:])
        return sum(rid not in batches[i].rids for i in range(first, last))

    ref, separate = _drive(model, reqs, overlap=False, **kw)
    assert all(b.decode or b.decode_from == len(b.rids) for b in separate)
    assert gaps(separate, "a") > 0 and gaps(separate, "b") > 0  # long's chunks ran without them
    for overlap in (False, True):
        out, batches = _drive(model, reqs, overlap=overlap, enable_mixed_chunk=True, **kw)
        assert out == ref
        assert any(not b.decode and 0 < b.decode_from < len(b.rids) for b in batches), batches
        assert gaps(batches, "a") == 0 and gaps(batches, "b") == 0, batches
        assert all(b.tokens <= 32 for b in batches), batches
        assert sum(b.tokens for b in batches) == sum(b.tokens for b in separate)


@pytest.mark.parametrize("apart", [True, False])
def test_a_mixed_batch_s_attention_metadata_splits_at_its_decode_rows(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, apart: bool) -> None:
    """A mixed batch tells the attention backend where its decode rows begin: from there each
    row is one query over its first kv_len slots (the decode kernel's input, a slice of the
    batch's KV indices). For a backend that reads cached prefixes apart (`apart`, as
    FlashInfer's past its paged threshold) the prefix fields describe the prompt chunks
    before it alone, each chunk's prefix being the first slots of its own KV (a chunk after
    the first has one: the earlier chunks'); for one that does not (the torch backend's
    own answer), they are left out."""
    from sgl.kernels.torch_attention import TorchAttentionBackend

    if apart:
        monkeypatch.setattr(TorchAttentionBackend, "reads_prefixes_apart", lambda self, tokens: True)
    model = tiny_model_dir(tmp_path_factory.mktemp("mixed-meta"), "llama", vocab=128, seed=5)
    rng = random.Random(4)
    reqs = [("a", [rng.randrange(1, 120) for _ in range(6)], 12),
            ("b", [rng.randrange(1, 120) for _ in range(5)], 9),
            ("long", [rng.randrange(1, 120) for _ in range(90)], 4)]
    prepared: list[Any] = []
    _drive(model, reqs, overlap=False, enable_mixed_chunk=True, chunked_prefill_size=32, max_total_tokens=2048,
           prepared=prepared)
    mixed = [(p, table) for p, table in prepared if p.batch.decode_from is not None]
    prefixed = [p for p, _ in mixed if any(k > q for k, q in zip(p.batch.kv_lens[:p.batch.decode_from],
                                                                 p.batch.qo_lens[:p.batch.decode_from]))]
    assert prefixed  # a later chunk of `long` among them
    assert all((p.attn.prefix_indptr_host is not None) == apart for p in prefixed)
    for p, table in mixed:
        m, b = p.attn, p.batch
        d = b.decode_from
        assert m.decode_from == d and not m.is_decode and 0 < d < len(b.reqs)
        assert m.qo_lens[d:] == [1] * (len(b.reqs) - d)
        kv_indptr = m.kv_indptr_host.tolist()
        for i, row in enumerate(b.rows):  # every row's KV, decode rows' included: its table slots
            assert m.kv_indices[kv_indptr[i]:kv_indptr[i + 1]].tolist() == table[row, :b.kv_lens[i]].tolist()
        prefixes = [k - q for k, q in zip(b.kv_lens[:d], b.qo_lens[:d])]
        if not (apart and any(prefixes)):
            assert m.prefix_indptr_host is None and m.prefix_indices is None
            continue
        assert m.prefix_indptr_host.tolist() == [0, *itertools.accumulate(prefixes)]
        assert m.prefix_lens_host.tolist() == prefixes
        want = [s for i in range(d) for s in table[b.rows[i], :prefixes[i]].tolist()]
        assert m.prefix_indices.tolist() == want


def test_a_mixed_batch_s_decode_rows_take_a_cascade_split_when_they_share_a_prefix(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows that begin with the same cached slots (two requests with one prompt
    prefix) ride a prompt's chunks as a cascade, as a decode step of theirs would: the
    shared slots once, each row's own suffix, and kv_indices still holding every row's slots
    for the chunks and the reference backend. Outputs are those of separate forwards."""
    from sgl.sched.runner import prepare as prep

    monkeypatch.setattr(prep, "CASCADE_MIN_SAVED_TOKENS", 1)
    model = tiny_model_dir(tmp_path_factory.mktemp("mixed-cascade"), "llama", vocab=128, seed=5)
    rng = random.Random(6)
    shared = [rng.randrange(1, 120) for _ in range(12)]
    reqs = [("a", shared + [rng.randrange(1, 120) for _ in range(3)], 16),
            ("b", shared + [rng.randrange(1, 120) for _ in range(2)], 14),
            ("long", [rng.randrange(1, 120) for _ in range(90)], 4)]
    kw: dict[str, Any] = {"chunked_prefill_size": 32, "max_total_tokens": 2048, "enable_cascade_attention": True}
    ref, _ = _drive(model, reqs, overlap=False, arrive=[0, 2, 4], **kw)
    prepared: list[Any] = []
    out, _ = _drive(model, reqs, overlap=False, arrive=[0, 2, 4], enable_mixed_chunk=True, prepared=prepared, **kw)
    assert out == ref
    split = [(p, table) for p, table in prepared if p.batch.decode_from is not None and p.attn.cascade is not None]
    assert split, "no mixed batch with a cascade split"
    for p, table in split:
        m, b, c = p.attn, p.batch, p.attn.cascade
        d = b.decode_from
        rows = b.rows[d:]
        assert c.shared_len >= len(shared) and c.shared_indices.tolist() == table[rows[0], :c.shared_len].tolist()
        assert all(table[r, :c.shared_len].tolist() == c.shared_indices.tolist() for r in rows)
        own = c.suffix_indptr_host.tolist()
        for i, r in enumerate(rows):
            assert c.suffix_indices[own[i]:own[i + 1]].tolist() == table[r, c.shared_len:b.kv_lens[d + i]].tolist()
        assert m.kv_indices.numel() == sum(b.kv_lens)
