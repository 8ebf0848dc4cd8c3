"""sgl's FlashInfer backend on the CPU, FlashInfer itself stood in for by
tests/fake_flashinfer.py: every mode's plans and runs (decode, extend with and without
cached prefixes, mixed batches whose decode rows take the decode kernel or a cascade,
cascade decode; the batches of tests/attn_batches.py), the CUDA-graph plans, and a whole
engine attending through it, with the Triton decode kernel under Triton's interpreter
where CI runs it, against the torch reference backend. What this checks is the backend's
own bookkeeping: which rows, indptrs and slots each plan gets, and how the parts' outputs
are put back together. The real kernels are tests/test_gpu.py's."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sgl.kernels.attention import AttnMetadata
from sgl.kernels.torch_attention import TorchAttentionBackend
from tests import fake_flashinfer
from tests.attn_batches import MODES, batch, indptr_of
from tests.hypothesis_profiles import PROFILE

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
try:
    import triton  # noqa: F401
except ImportError:
    INTERPRETED = False


@contextmanager
def cpu_flashinfer() -> Iterator[None]:
    """The backend importable and constructible on a CPU: the stand-in module, no pinned
    memory and no CUDA events (its plans' copy ordering is the GPU's concern), a small
    workspace."""
    from sgl.kernels import flashinfer_attention as fa

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
        mp.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
        mp.setattr(fa.FlashInferAttentionBackend, "_before_plan", lambda self: None)
        mp.setattr(fa.FlashInferAttentionBackend, "_after_plan", lambda self: None)
        mp.setattr(fa, "WORKSPACE_BYTES", 1024)
        yield


@settings(PROFILE, max_examples=25, deadline=None)
@given(mode=st.sampled_from(MODES), heads=st.sampled_from([(4, 2), (8, 2), (2, 2), (8, 1)]),
       d=st.sampled_from([16, 32]), triton_decode=st.booleans() if INTERPRETED else st.just(False),
       seed=st.integers(0, 2**16), paged_extend=st.booleans())
@example(mode="mixed_cascade", heads=(4, 2), d=16, triton_decode=False, seed=3, paged_extend=True)
@example(mode="mixed_prefix", heads=(4, 2), d=16, triton_decode=False, seed=3, paged_extend=False)
def test_every_mode_equals_the_torch_reference(mode: str, heads: tuple[int, int], d: int, triton_decode: bool,
                                               seed: int, paged_extend: bool) -> None:
    """paged_extend: extends with cached prefixes as one paged prefill (these batches are
    short), else as ragged + paged + merge."""
    rng = random.Random(seed)
    hq, hkv = heads
    slots = 400
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots + 1, hkv, d, generator=g).half()
    v_cache = torch.randn(slots + 1, hkv, d, generator=g).half()
    meta, new_slots = batch(mode, rng, slots)
    q = torch.randn(len(new_slots), hq, d, generator=g).half()
    k, v = k_cache[new_slots], v_cache[new_slots]
    ref = TorchAttentionBackend()
    ref.begin_forward(meta)
    want = ref.forward(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), d**-0.5)
    with cpu_flashinfer():
        from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

        fi = FlashInferAttentionBackend(hq, hkv, d, torch.float16, torch.device("cpu"), slots + 1,
                                        triton_decode=triton_decode,
                                        paged_extend_max_tokens=10**6 if paged_extend else 0)
        fi.begin_forward(meta)
        got = fi.forward(q, k, v, k_cache, v_cache, d**-0.5)
    assert got.shape == want.shape and got.dtype == torch.float16
    assert torch.allclose(got.float(), want, atol=2e-3, rtol=2e-3), (mode, (got.float() - want).abs().max())


@pytest.mark.parametrize("paged_extend", [False, True])
def test_a_mixed_batch_plans_its_parts(paged_extend: bool) -> None:
    """Under the paged threshold a mixed batch without a cascade is one causal paged
    prefill over every row's whole KV (a decode row: one query); past it, the extend rows'
    plans see those rows alone (their query tokens and their prefixes), and FlashInfer's
    decode plan the decode rows' KV from 0 over their slice of the indices."""
    rng = random.Random(7)
    for _ in range(20):
        meta, _ = batch("mixed_prefix", rng, 400)
        d = meta.decode_from
        assert d is not None and meta.cascade is None
        with cpu_flashinfer():
            from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

            fi = FlashInferAttentionBackend(4, 2, 16, torch.float16, torch.device("cpu"), 401,
                                            paged_extend_max_tokens=10**6 if paged_extend else 0)
            fi.begin_forward(meta)
        if paged_extend:
            assert fi._mode == "extend" and fi._extend_kind == "paged"
            assert fi.paged.qo == meta.qo_indptr_host.tolist() and fi.paged.causal
            assert fi.paged._kv()[0] == meta.kv_indptr_host.tolist()
            assert not fi.decode.planned
            continue
        assert fi._mode == "mixed" and fi._extend_kind == "split"
        assert fi.ragged.qo == meta.qo_indptr_host[: d + 1].tolist()
        assert fi.paged._kv()[0] == meta.prefix_indptr_host.tolist() and not fi.paged.causal
        start = int(meta.kv_indptr_host[d])
        indptr, indices = fi.decode._kv()
        assert indptr == (meta.kv_indptr_host[d:] - start).tolist()
        assert torch.equal(indices, meta.kv_indices[start:])


@pytest.mark.parametrize("mode", ["extend_prefix", "mixed", "mixed_prefix"])
def test_the_paged_threshold_counts_every_query_token(mode: str) -> None:
    """One paged prefill up to paged_extend_max_tokens query tokens in the batch, decode
    rows included; one token more and the batch splits."""
    rng = random.Random(11)
    for _ in range(10):
        meta, _ = batch(mode, rng, 400)
        tokens = int(meta.qo_indptr_host[-1])
        for limit, kind in ((tokens, "paged"), (tokens - 1, "split" if meta.prefix_indptr_host is not None
                                                           else "ragged")):
            with cpu_flashinfer():
                from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

                fi = FlashInferAttentionBackend(4, 2, 16, torch.float16, torch.device("cpu"), 401,
                                                paged_extend_max_tokens=limit)
                fi.begin_forward(meta)
            assert fi._extend_kind == kind, (mode, limit, tokens)
            assert fi._mode == ("extend" if kind == "paged" or meta.decode_from is None else "mixed")


@settings(PROFILE, max_examples=15, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["decode", "cascade"]), st.sampled_from([4, 2]),
                                st.integers(0, 2), st.integers(0, 2**16)), min_size=2, max_size=8),
       triton_decode=st.booleans() if INTERPRETED else st.just(False), heads=st.sampled_from([(4, 2), (8, 1)]))
# One size's prefix, another size's over the shared buffer, then the first again: its plan must run again.
@example(steps=[("cascade", 4, 0, 1), ("cascade", 2, 1, 2), ("cascade", 4, 0, 3)], triton_decode=False,
         heads=(4, 2))
def test_graph_plans_read_what_their_buffers_hold(steps: list[tuple[str, int, int, int]], triton_decode: bool,
                                                  heads: tuple[int, int]) -> None:
    """Decode and cascade batches planned for CUDA graphs of two sizes in any order, with
    real rows fewer than the size padded as the graph runner pads them: each replay reads
    its plan from the index buffers every size shares, and a cascade may skip planning its
    shared block again only while that buffer still holds its prefix (CascadeMeta.key). A
    stale skip would read another prefix's slots. Each step against the torch reference."""
    from sgl.sched.runner.cuda_graph import _pad

    hq, hkv = heads
    d, slots = 16, 400
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(slots + 1, hkv, d, generator=g).half()
    v_cache = torch.randn(slots + 1, hkv, d, generator=g).half()
    perm = (torch.randperm(slots, generator=g) + 1).to(torch.int32)
    prefixes = [perm[:30], perm[30:45], perm[45:85]]  # three shared prefixes; suffix slots from 100 on
    with cpu_flashinfer():
        from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

        fi = FlashInferAttentionBackend(hq, hkv, d, torch.float16, torch.device("cpu"), slots + 1,
                                        triton_decode=triton_decode)
        for bs in (4, 2):  # the largest first, as the graph runner captures
            fi.init_graph(bs, cascade=True)
        for kind, bs, which, seed in steps:
            rng = random.Random(seed)
            b = rng.randint(1, bs)
            shared = prefixes[which]
            own = [rng.randint(1, 20) for _ in range(b)]
            rest = perm[100: 100 + sum(own)]
            own_indptr = indptr_of(own)
            full = torch.cat([torch.cat([shared, rest[own_indptr[i]: own_indptr[i + 1]]]) for i in range(b)])
            kv_lens = [len(shared) + n for n in own]
            meta = AttnMetadata(True, torch.arange(b + 1, dtype=torch.int32), indptr_of(kv_lens), full, [1] * b,
                                kv_lens, indptr_of(kv_lens), torch.arange(b + 1, dtype=torch.int32))
            q = torch.randn(bs, hq, d, generator=torch.Generator().manual_seed(seed)).half()
            ref = TorchAttentionBackend()
            ref.begin_forward(meta)
            want = ref.forward(q[:b].float(), q[:b].float(), q[:b].float(), k_cache.float(), v_cache.float(),
                               d**-0.5)
            if kind == "cascade":
                indptr, indices = _pad(own_indptr, rest, bs)
                fi.begin_graph_cascade(bs, len(shared), shared, indptr, indices, key=("prefix", which))
            else:
                indptr, indices = _pad(meta.kv_indptr_host, full, bs)
                fi.begin_graph_decode(bs, indptr, indices, fi.picks_tensor_cores(bs, indptr, 0))
            got = fi.forward(q, q, q, k_cache, v_cache, d**-0.5)[:b]
            assert torch.allclose(got.float(), want, atol=2e-3, rtol=2e-3), (kind, bs, which)


@settings(PROFILE, max_examples=25, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**16), min_size=1, max_size=4), heads=st.sampled_from([(4, 2), (8, 1)]),
       pad=st.integers(0, 12))
def test_extend_graph_plans_pad_requests_and_rows(seeds: list[int], heads: tuple[int, int], pad: int) -> None:
    """Prefix-cached extends, one after another, planned into the one graph-mode wrapper of
    whole extend graphs (at most 4 requests, 64 tokens), each run over its query rows plus
    `pad` padding rows as a graph's fixed buffer holds them: the real rows equal the torch
    reference, the padding rows are zeros, and takes_extend_graph takes exactly the
    batches that read cached KV."""
    hq, hkv = heads
    d, slots = 16, 400
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(slots + 1, hkv, d, generator=g).half()
    v_cache = torch.randn(slots + 1, hkv, d, generator=g).half()
    with cpu_flashinfer():
        from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

        fi = FlashInferAttentionBackend(hq, hkv, d, torch.float16, torch.device("cpu"), slots + 1)
        fi.init_extend_graph(64, 4)
        for seed in seeds:
            rng = random.Random(seed)
            meta, new_slots = batch(rng.choice(["extend", "extend_prefix"]), rng, slots)
            n = len(new_slots)
            qo, kv = meta.qo_indptr_host, meta.kv_indptr_host
            assert qo is not None and kv is not None
            assert fi.takes_extend_graph(meta) == (len(meta.qo_lens) <= 4 and int(kv[-1]) > n and n <= 1024)
            if len(meta.qo_lens) > 4 or n > 64:
                continue  # not a batch these graphs take
            q = torch.randn(n + pad, hq, d, generator=torch.Generator().manual_seed(seed)).half()
            ref = TorchAttentionBackend()
            ref.begin_forward(meta)
            k, v = k_cache[new_slots], v_cache[new_slots]
            want = ref.forward(q[:n].float(), k.float(), v.float(), k_cache.float(), v_cache.float(), d**-0.5)
            fi.begin_graph_extend(qo, kv, meta.kv_indices)
            got = fi.forward(q, q, q, k_cache, v_cache, d**-0.5)
            assert torch.allclose(got[:n].float(), want, atol=2e-3, rtol=2e-3), seed
            assert not got[n:].any()


# Triton's decode kernel runs plain decode steps and, without paged extends, a mixed batch's
# decode rows; with them its decode rows go through the paged prefill, as on FlashInfer's
# decode kernel: that pairing adds nothing but the interpreter's time (40 s).
@pytest.mark.parametrize(("triton_decode", "paged_extend"),
                         [(False, False), (False, True), *([(True, False)] if INTERPRETED else [])])
def test_an_engine_through_the_backend_agrees_with_the_torch_one(tmp_path: Path, triton_decode: bool,
                                                                 paged_extend: bool) -> None:
    """A whole engine (float16, the overlap loop) whose runner attends through the FlashInfer
    backend over the stand-in: prompt chunks that carry the running requests' steps (mixed
    batches: one paged prefill, or the chunks' kernels and the decode kernel, by
    `paged_extend`), decode rows sharing a cached prefix (cascades, plain and mixed),
    prefix-cached extends. Against the same engine on the torch backend, each request's top
    logprobs agree to float16's precision up to its first near-tie flip; the prefixes' slots
    are gathered for the split path alone (one paged prefill reads every row's whole KV)."""
    import sgl
    from sgl.sched.runner import prepare as prep
    from sgl.sched.runner.model_runner import ModelRunner
    from tests.conftest import assert_top_logprobs_agree, generate_after_prefix, tiny_model_dir

    model = tiny_model_dir(tmp_path, "qwen3", vocab=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128)
    rng = random.Random(9)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = ([shared + [rng.randrange(256) for _ in range(n)] for n in (2, 5, 9, 3)]
               + [[rng.randrange(256) for _ in range(n)] for n in (120, 7)])
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run(flashinfer: bool) -> tuple[list[dict], dict]:
        with sgl.Engine(model, transport="inproc", skip_tokenizer_init=True, dtype="float16", device="cpu",
                        max_total_tokens=4000, chunked_prefill_size=48, enable_mixed_chunk=True,
                        enable_cascade_attention=True, disable_overlap_schedule=False) as e:
            return generate_after_prefix(e, shared, prompts, params)

    from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

    extends: list[tuple[str, bool]] = []  # each extend's kind, and whether it came with its prefixes' slots

    def backend(self: ModelRunner, args: object, m: Any) -> FlashInferAttentionBackend:
        fi = FlashInferAttentionBackend(m.num_heads, m.num_kv_heads, m.head_dim, self.dtype, self.device,
                                        self.max_total_tokens + 1, context_length=self.context_length,
                                        triton_decode=triton_decode,
                                        paged_extend_max_tokens=10**6 if paged_extend else 0)
        plan = fi.begin_forward

        def begin_forward(meta: AttnMetadata) -> None:
            plan(meta)
            if not meta.is_decode:
                extends.append((fi._extend_kind, meta.prefix_indices is not None))

        fi.begin_forward = begin_forward  # type: ignore[method-assign]
        return fi

    alone, _ = run(flashinfer=False)
    with cpu_flashinfer(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "_attention_backend", backend)
        mp.setattr(prep, "CASCADE_MIN_SAVED_TOKENS", 1)
        through, info = run(flashinfer=True)
    assert info["mixed_steps"] > 0 and info["cascade_steps"] > 0, info
    assert_top_logprobs_agree(through, alone)
    assert all(gathered == (kind == "split") for kind, gathered in extends), extends
    assert ("paged" if paged_extend else "split") in {kind for kind, _ in extends}


def test_whole_extend_graphs_agree_with_the_torch_engine(tmp_path: Path) -> None:
    """Extend batches of up to 8 requests and 64 tokens that read cached KV through one
    whole forward over the fixed, padded buffers, attention planned into the graph-mode
    wrapper (eagerly here: PrefillGraphs(capture=False)); the rest through the pieces:
    prefix-cached turns (a chat's) and a long prompt's later chunks take the whole graph,
    fresh prompts, a batch of more requests than it plans, and decode steps the pieces.
    Against the same engine on the torch backend without graphs, each request's top
    logprobs agree to float16's precision up to its first near-tie flip, and no plan of
    the graph-mode wrapper exceeded its first plan's tokens (the stand-in checks)."""
    import sgl
    from sgl.sched.runner.model_runner import ModelRunner
    from sgl.sched.runner.prefill_graph import WHOLE_MAX_REQUESTS, PrefillGraphs
    from tests.conftest import assert_top_logprobs_agree, generate_after_prefix, tiny_model_dir

    model = tiny_model_dir(tmp_path, "qwen3", vocab=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128)
    rng = random.Random(11)
    shared = [rng.randrange(256) for _ in range(40)]
    turns = [shared + [rng.randrange(256) for _ in range(n)] for n in (2, 5, 9)]
    lone = [[rng.randrange(256) for _ in range(n)] for n in (1, 30, 64, 65, 150)]
    many = [[rng.randrange(256) for _ in range(rng.randint(1, 5))] for _ in range(WHOLE_MAX_REQUESTS + 3)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

    def run(e: Any) -> tuple[list[dict], dict]:
        outs, info = generate_after_prefix(e, shared, turns, params)
        for p in lone:  # one at a time: a batch of one request, chunked past 64 tokens
            outs += e.generate(input_ids=[p], sampling_params=params, return_logprob=True, top_logprobs_num=3)
        outs += e.generate(input_ids=many, sampling_params=params, return_logprob=True, top_logprobs_num=3)
        return outs, e.get_server_info()

    def engine() -> Any:
        return sgl.Engine(model, transport="inproc", skip_tokenizer_init=True, dtype="float16", device="cpu",
                          max_total_tokens=4000, chunked_prefill_size=96)

    with engine() as e:
        alone, _ = run(e)

    asked: list[tuple[bool, bool]] = []  # per extend batch the pieces' graphs got: (taken whole, its rule's answer)

    def backend(self: ModelRunner, args: object, m: Any) -> Any:
        from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend

        fi = FlashInferAttentionBackend(m.num_heads, m.num_kv_heads, m.head_dim, self.dtype, self.device,
                                        self.max_total_tokens + 1, context_length=self.context_length)
        takes = fi.takes_extend_graph

        def takes_extend_graph(meta: AttnMetadata) -> bool:
            taken = takes(meta)
            if not meta.is_decode:
                qo, kv = meta.qo_indptr_host, meta.kv_indptr_host
                assert qo is not None and kv is not None
                asked.append((taken, len(meta.qo_lens) <= WHOLE_MAX_REQUESTS and int(kv[-1]) > int(qo[-1])))
            return taken

        fi.takes_extend_graph = takes_extend_graph  # type: ignore[method-assign]
        return fi

    def eager_graphs(self: ModelRunner) -> None:
        self.prefill_graphs = PrefillGraphs(self, 64, capture=False)

    with cpu_flashinfer(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "_attention_backend", backend)
        mp.setattr(ModelRunner, "_capture_graphs", eager_graphs)
        with engine() as e:
            through, info = run(e)
    assert all(taken == rule for taken, rule in asked), asked
    assert {rule for _, rule in asked} == {True, False}, asked  # both kinds of batch came
    assert 0 < info["prefill_whole_graph_steps"] < info["prefill_graph_steps"], info
    assert_top_logprobs_agree(through, alone)
