"""Traffic must never hang or crash the scheduler.

- Liveness under retraction: requests that each fit the KV pool alone but not
  together (chunked prefill taking the room a running request needs) all finish,
  with exact outputs, within a step bound, the scheduler driven one `step()` at a
  time on the null model; and the same on a random mix (Hypothesis).
- Per-batch failure containment, on the inproc transport with a tiny model, overlap
  on and off: an exception in prepare, in the forward (prefill or decode), in one
  request's result processing (a double-free RuntimeError too), in building a batch,
  or a CUDA OOM (retracted and retried once, aborted the second time) ends that
  batch's requests (or that request) with an abort reason; later requests finish
  exactly as on a reference engine, KV balances, and KV that a failed chunk never
  wrote is not served from the radix cache afterwards. Batch failures are planted
  with sgl.testing.inject_faults where a request's token count places them.
- Chunked prefill is on by default and prompt logprobs do not depend on the chunk.
- A bounded waiting queue refuses past max_queued_requests with status_code 503.
- A decode batch sums a shared prefix once per request: the accounting of the
  shape that overflowed FlashInfer's CUDA-graph index buffer (see test_gpu.py)."""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sgl
from sgl.core.protocol import BatchTokenIDOutput, GenerateReqInput
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.kernels.flashinfer_attention import graph_indices_len
from sgl.sched.prefill import PrefillAdder
from sgl.sched.results import ResultProcessor
from sgl.sched.runner.model_runner import ModelRunner
from sgl.sched.scheduler import Scheduler
from sgl.testing.faults import Fail, FaultPlan, Rid, inject_faults
from tests.conftest import assert_kv_balanced, null_continuation, tiny_model_dir
from tests.fake_channels import ListSender, QueueReceiver
from tests.hypothesis_profiles import PROFILE

GREEDY = {"temperature": 0, "ignore_eos": True}


# ---- a scheduler driven a step at a time -------------------------------------

class Driver:
    def __init__(self, model_dir: str, **kw: Any) -> None:
        self.inbox, self.out = QueueReceiver(), ListSender()
        kw.setdefault("skip_tokenizer_init", True)
        args = ServerArgs(model_path=model_dir, device="cpu", **kw)
        self.s = Scheduler(args, model_dir, self.inbox, self.out)
        self.ids: dict[str, list[int]] = collections.defaultdict(list)
        self.reasons: dict[str, dict[str, Any]] = {}

    def submit(self, rid: str, ids: list[int], n: int, **params: Any) -> None:
        self.inbox.q.append(GenerateReqInput(rid, ids, SamplingParams(max_new_tokens=n, **{**GREEDY, **params})))

    def run(self, max_steps: int) -> int:
        """Steps until idle; fails (a livelock) past max_steps."""
        s = self.s
        for i in range(max_steps):
            s.step()
            for m in self.out.msgs:
                if isinstance(m, BatchTokenIDOutput):
                    for rid, new, fin in zip(m.rids, m.new_ids, m.finished_reasons):
                        self.ids[rid] += new
                        if fin is not None:
                            self.reasons[rid] = fin
            self.out.msgs.clear()
            if not self.inbox.q and s.idle:
                return i
        raise AssertionError(f"no progress: not idle after {max_steps} steps: {s.info()}")

    def balanced(self) -> None:
        self.s.step()  # idle: the scheduler checks its own invariants (strict in tests)
        self.s.kv.tree.check_invariants(None)
        assert_kv_balanced(self.s.info())


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("chunk", [8, 16])
def test_fit_alone_requests_finish_under_retraction(null_model_dir: str, overlap: bool, chunk: int) -> None:
    """The issue's livelock, with sizes the submit check lets through: A (10 + 85) and
    B (95 + 5) each fit the 100-slot pool alone. B's chunks take the room A's decode
    needs; the youngest KV holder (B) must yield, not A (which used to be aborted as
    'cannot fit', or retracted in front of B round after round)."""
    d = Driver(null_model_dir, load_format="null", max_total_tokens=100, chunked_prefill_size=chunk,
               disable_overlap_schedule=not overlap)
    a, b = list(range(1, 11)), list(range(100, 195))
    d.submit("A", a, 85)
    d.submit("B", b, 5)
    d.run(max_steps=1000)
    assert d.reasons == {"A": {"type": "length", "length": 85}, "B": {"type": "length", "length": 5}}
    assert d.ids["A"] == null_continuation(a[-1], 85) and d.ids["B"] == null_continuation(b[-1], 5)
    d.balanced()


@settings(PROFILE, max_examples=30)
@given(st.lists(st.tuples(st.integers(1, 95), st.integers(1, 99)), min_size=2, max_size=8),
       st.sampled_from([-1, 8, 16, 32]), st.booleans(), st.randoms(use_true_random=False))
def test_random_fit_alone_mixes_all_finish(null_model_dir: str, sizes: list[tuple[int, int]], chunk: int,
                                          overlap: bool, rng: random.Random) -> None:
    total = 100
    d = Driver(null_model_dir, load_format="null", max_total_tokens=total, chunked_prefill_size=chunk,
               disable_overlap_schedule=not overlap)
    want = {}
    for i, (p, n) in enumerate(sizes):
        n = min(n, total - p)  # fits alone: prompt + max_new_tokens <= the pool
        ids = [rng.randrange(1, 999) for _ in range(p)]
        d.submit(f"r{i}", ids, n)
        want[f"r{i}"] = null_continuation(ids[-1], n)
    d.run(max_steps=20 * total * len(sizes))
    assert {r: f["type"] for r, f in d.reasons.items()} == dict.fromkeys(want, "length")
    assert dict(d.ids) == want
    d.balanced()


@pytest.mark.timeout(60)
def test_engine_livelock_case_ends_in_time(null_model_dir: str) -> None:
    with sgl.Engine(null_model_dir, transport="inproc", load_format="null", skip_tokenizer_init=True,
                    max_total_tokens=100, chunked_prefill_size=16, disable_overlap_schedule=False) as e:
        outs = e.generate(input_ids=[list(range(1, 11)), list(range(100, 195))],
                          sampling_params=[{**GREEDY, "max_new_tokens": 85}, {**GREEDY, "max_new_tokens": 5}])
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length", "length"]
        assert_kv_balanced(e.get_server_info())



# ---- failure containment -----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-trust"), "llama", vocab=512, seed=3,
                          max_position_embeddings=2048)


@pytest.fixture(scope="module")
def reference(tiny_dir: str) -> Iterator[sgl.Engine]:
    e = sgl.Engine(tiny_dir, transport="inproc", skip_tokenizer_init=True, disable_radix_cache=True,
                   disable_overlap_schedule=True, chunked_prefill_size=-1, max_total_tokens=8192)
    yield e
    e.shutdown()


_rng = random.Random(4)
PROMPTS = [[_rng.randrange(1, 500) for _ in range(_rng.randint(5, 40))] for _ in range(6)]
BAD = [_rng.randrange(1, 500) for _ in range(48)]
N = 6


def inject(monkeypatch: pytest.MonkeyPatch, rid: str, nth: int | None, make: Callable[[], BaseException],
           stage: str = "forward") -> collections.Counter[str]:
    """Raise make() in the runner's `stage` (prepare or forward) of the nth batch holding
    `rid` (of every one if nth is None); the count of those batches so far."""
    rids: dict[int, list[str]] = {}
    seen: collections.Counter[str] = collections.Counter()
    prepare, forward = ModelRunner.prepare, ModelRunner._logits

    def hit() -> bool:
        seen[rid] += 1
        return nth is None or seen[rid] == nth

    def prepare_(self: ModelRunner, batch: Any) -> Any:
        names = [r.rid for r in batch.reqs]
        if stage == "prepare" and rid in names and hit():
            raise make()
        p = prepare(self, batch)
        rids[id(p)] = names
        return p

    def forward_(self: ModelRunner, p: Any) -> Any:
        if stage == "forward" and rid in rids.pop(id(p), []) and hit():
            raise make()
        return forward(self, p)

    monkeypatch.setattr(ModelRunner, "prepare", prepare_)
    monkeypatch.setattr(ModelRunner, "_logits", forward_)
    return seen


def _engine(tiny_dir: str, overlap: bool, *faults: Fail, **kw: Any) -> sgl.Engine:
    """An engine whose request "bad" meets `faults`."""
    e = sgl.Engine(tiny_dir, transport="inproc", skip_tokenizer_init=True, disable_overlap_schedule=not overlap,
                   max_total_tokens=2048, **kw)
    if faults:
        plan = FaultPlan()
        for f in faults:
            plan.add(f, Rid("bad"))
        asyncio.run(inject_faults(e, plan))
    return e


def _run_mix(e: sgl.Engine, reference: sgl.Engine, bad_must: str) -> dict[str, Any]:
    """The bad request among good ones, then good ones alone: a good one is exact or
    (only if it shared the failing batch) aborted with the same message; the later
    ones are all exact; KV balances."""
    sp = {**GREEDY, "max_new_tokens": N}
    outs = e.generate(input_ids=[PROMPTS[0], BAD, PROMPTS[1]], sampling_params=sp, rid=["g0", "bad", "g1"])
    bad = outs[1]["meta_info"]["finish_reason"]
    assert bad["type"] == bad_must, bad
    for out, p in zip((outs[0], outs[2]), PROMPTS[:2]):
        fin = out["meta_info"]["finish_reason"]
        assert fin == {"type": "length", "length": N} or fin == bad, fin
        if fin["type"] == "length":
            assert out["output_ids"] == reference.generate(input_ids=p, sampling_params=sp)["output_ids"]
    later = e.generate(input_ids=[*PROMPTS[2:], BAD], sampling_params=sp)
    want = reference.generate(input_ids=[*PROMPTS[2:], BAD], sampling_params=sp)
    assert [o["output_ids"] for o in later] == [o["output_ids"] for o in want]
    info = e.get_server_info()
    assert_kv_balanced(info)
    return bad


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("stage, after", [("forward", 0), ("forward", 2), ("prepare", 1)],
                         ids=["forward-prefill", "forward-decode", "prepare"])
def test_a_failing_batch_aborts_its_requests_only(tiny_dir: str, reference: sgl.Engine, overlap: bool, stage: Any,
                                                 after: int) -> None:
    with _engine(tiny_dir, overlap, Fail(after, stage, message="injected kernel error")) as e:
        bad = _run_mix(e, reference, "abort")
        assert "injected kernel error" in bad["message"] and stage in bad["message"]
        assert e.get_server_info()["failures"] >= 1


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_cuda_oom_retracts_once_then_aborts(tiny_dir: str, reference: sgl.Engine, overlap: bool) -> None:
    def oom(after: int) -> Fail:
        return Fail(after, error="OutOfMemoryError", message="injected: CUDA out of memory")

    with _engine(tiny_dir, overlap, oom(1)) as e:  # its first decode step: retracted, re-prefilled, done
        _run_mix(e, reference, "length")
        info = e.get_server_info()
        assert info["retractions"] >= 1 and info["failures"] >= 1
    with _engine(tiny_dir, overlap, oom(0), oom(0)) as e:  # its prefill, and the retry too
        assert "OutOfMemoryError" in _run_mix(e, reference, "abort")["message"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("kind", ["finish_reason", "double_free"])
def test_one_requests_result_processing_failure_aborts_it_alone(tiny_dir: str, reference: sgl.Engine,
                                                                monkeypatch: Any, overlap: bool, kind: str) -> None:
    """Processing is per request: batch-mates of the failing one are exact too."""
    if kind == "finish_reason":
        orig = ResultProcessor._finish_reason

        def finish_reason(self: ResultProcessor, req: Any, tok: int) -> Any:
            if req.rid == "bad" and len(req.output_ids) == 2:
                raise ValueError("injected processing error")
            return orig(self, req, tok)

        monkeypatch.setattr(ResultProcessor, "_finish_reason", finish_reason)
    else:
        from sgl.cache.radix_cache import RadixCache

        cache = RadixCache.cache_unfinished_req

        def cache_unfinished_req(self: RadixCache, req: Any) -> None:
            if req.rid == "bad" and req.prompt_done:
                raise RuntimeError("KV double free: injected")
            cache(self, req)

        monkeypatch.setattr(RadixCache, "cache_unfinished_req", cache_unfinished_req)
    with _engine(tiny_dir, overlap) as e:
        sp = {**GREEDY, "max_new_tokens": N}
        outs = e.generate(input_ids=[PROMPTS[0], BAD, PROMPTS[1]], sampling_params=sp, rid=["g0", "bad", "g1"])
        fin = outs[1]["meta_info"]["finish_reason"]
        assert fin["type"] == "abort" and "result processing" in fin["message"], fin
        want = reference.generate(input_ids=[PROMPTS[0], PROMPTS[1]], sampling_params=sp)
        assert [outs[0]["output_ids"], outs[2]["output_ids"]] == [o["output_ids"] for o in want]
        _run_mix(e, reference, "abort")
        assert_kv_balanced(e.get_server_info())


def test_a_request_whose_kv_release_raises_still_ends(null_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its finish reason is set before the release raises: it is sent and forgotten all the
    same (the leaked KV is the idle check's to report), and its batch-mates are untouched."""
    from sgl.cache.radix_cache import RadixCache

    monkeypatch.setenv("SGL_STRICT_INVARIANTS", "0")  # the leak must be reported, not raised, here
    d = Driver(null_model_dir, load_format="null")
    cache = RadixCache.cache_finished_req

    def broken(self: RadixCache, req: Any) -> None:
        if req.rid == "bad":
            raise RuntimeError("injected release failure")
        cache(self, req)

    monkeypatch.setattr(RadixCache, "cache_finished_req", broken)
    d.submit("bad", [1, 2, 3], 3)
    d.submit("good", [4, 5, 6], 3)
    d.run(max_steps=50)
    assert d.reasons["good"] == {"type": "length", "length": 3} and d.ids["good"] == null_continuation(6, 3)
    assert "bad" in d.reasons and "bad" not in d.s.rids


def test_a_failure_while_building_a_batch_aborts_the_request(tiny_dir: str, reference: sgl.Engine,
                                                             monkeypatch: Any) -> None:
    admit = PrefillAdder._admit

    def _admit(self: PrefillAdder, req: Any, match: Any, n: int) -> None:
        if req.rid == "bad":
            raise RuntimeError("injected admission error")
        admit(self, req, match, n)

    monkeypatch.setattr(PrefillAdder, "_admit", _admit)
    with _engine(tiny_dir, True) as e:
        assert "scheduling" in _run_mix(e, reference, "abort")["message"]


def test_unwritten_kv_of_a_failed_chunk_is_not_reused(tiny_dir: str, reference: sgl.Engine, monkeypatch: Any) -> None:
    """Overlap: chunk 3 is built (caching chunk 2 in the tree) before chunk 2's forward
    is found failed. Chunk 2's KV was never written: a later request with the same
    prompt must not match it."""
    inject(monkeypatch, "bad", 2, lambda: RuntimeError("injected kernel error"))
    sp = {**GREEDY, "max_new_tokens": N}
    with _engine(tiny_dir, True, chunked_prefill_size=16) as e:
        assert e.generate(input_ids=BAD, sampling_params=sp, rid="bad")["meta_info"]["finish_reason"]["type"] == "abort"
        again = e.generate(input_ids=BAD, sampling_params=sp)
        assert again["output_ids"] == reference.generate(input_ids=BAD, sampling_params=sp)["output_ids"]
        assert_kv_balanced(e.get_server_info())


# ---- chunked prefill by default, bounded queue, shared-prefix accounting -----

def test_chunked_prefill_is_on_by_default(null_model_dir: str) -> None:
    assert Driver(null_model_dir, load_format="null").s.info()["chunked_prefill_size"] == 2048
    unchunked = Driver(null_model_dir, load_format="null", chunked_prefill_size=-1)
    assert unchunked.s.prefill.chunk_size == 512  # the context
    for bad in (0, -2):
        with pytest.raises(ValueError, match="chunked_prefill_size"):
            ServerArgs(chunked_prefill_size=bad)


def test_prompt_logprobs_do_not_depend_on_the_chunk(tiny_dir: str, reference: sgl.Engine) -> None:
    sp = {**GREEDY, "max_new_tokens": 3}
    lp = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    want = reference.generate(input_ids=BAD, sampling_params=sp, **lp)["meta_info"]
    with _engine(tiny_dir, False, chunked_prefill_size=7, disable_radix_cache=True) as e:
        got = e.generate(input_ids=BAD, sampling_params=sp, **lp)["meta_info"]
    assert [t for _, t, _ in got["input_token_logprobs"]] == BAD
    assert got["input_token_logprobs"][0][0] is None
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(got[key]) == len(want[key])
        for (v, t, _), (w, u, _) in zip(got[key], want[key]):
            assert t == u and (v is None) == (w is None) and (v is None or abs(v - w) < 1e-4)


def test_past_max_queued_requests_new_ones_get_503(null_model_dir: str) -> None:
    d = Driver(null_model_dir, load_format="null", max_total_tokens=100, max_queued_requests=2)
    for i in range(5):
        d.submit(f"q{i}", [1 + i, 2], 3)
    d.run(max_steps=100)
    for i in range(2, 5):
        assert d.reasons[f"q{i}"] == {"type": "abort", "status_code": 503, "message":
                                      "server busy: 2 queued requests (max_queued_requests=2); retry later"}
    assert [d.reasons[f"q{i}"]["type"] for i in range(2)] == ["length", "length"]
    d.submit("later", [7], 2)  # the queue drained: served again
    d.run(max_steps=100)
    assert d.reasons["later"]["type"] == "length"
    d.balanced()
    assert ServerArgs().max_queued_requests == 4096


def test_shared_prefix_decode_batch_sums_past_the_pool(tiny_dir: str, reference: sgl.Engine,
                                                       monkeypatch: Any) -> None:
    """The shape that crashed FlashInfer's graph plan on an H200: 64 requests on a cached
    1,000-token prefix plus one unrelated one in a pool of 20,000 slots. A decode batch
    counts the prefix once per request, so its KV indices outnumber the pool (no fixed
    buffer on the torch backend); the graph buffers' size bounds them."""
    sums: list[tuple[int, int]] = []
    prepare = ModelRunner.prepare

    def prepare_(self: ModelRunner, batch: Any) -> Any:
        if batch.is_decode:
            sums.append((len(batch.kv_lens), sum(batch.kv_lens)))
        return prepare(self, batch)

    monkeypatch.setattr(ModelRunner, "prepare", prepare_)
    rng = random.Random(9)
    prefix = [rng.randrange(1, 500) for _ in range(1000)]
    prompts = [prefix + [rng.randrange(1, 500) for _ in range(4)] for _ in range(64)]
    prompts.append([rng.randrange(1, 500) for _ in range(30)])
    sp = {**GREEDY, "max_new_tokens": 3}
    with sgl.Engine(tiny_dir, transport="inproc", skip_tokenizer_init=True, max_total_tokens=20000) as e:
        e.generate(input_ids=prefix + [1], sampling_params=sp)  # caches the prefix
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        info = e.get_server_info()
        assert_kv_balanced(info)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    b, widest = max(sums, key=lambda t: t[1])
    assert b > 20 and widest > info["max_total_tokens"] + 1 + b  # past the old graph buffer
    assert widest <= graph_indices_len(b, info["context_length"])
    for i in (0, 64):
        assert outs[i]["output_ids"] == reference.generate(input_ids=prompts[i], sampling_params=sp)["output_ids"]
