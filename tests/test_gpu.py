"""GPU path (marked gpu; skipped without CUDA): the FlashInfer backend, layer kernels,
the Triton KV write and top-k/top-p renormalisation against the torch reference on
the same batches, and CUDA graph replay against eager (a decode batch whose KV
indices outnumber the pool included)."""

from __future__ import annotations

import random

import pytest
import torch

import sgl
from tests.conftest import assert_kv_balanced, assert_top_logprobs_agree, generate_after_prefix, tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize(("mode", "triton", "paged_extend"),
                         [("decode", False, True), ("extend", False, True), ("extend_prefix", False, True),
                          ("extend_prefix", False, False), ("mixed", False, True), ("mixed", False, False),
                          ("mixed", True, False), ("mixed_prefix", False, True), ("mixed_prefix", False, False),
                          ("mixed_prefix", True, False)])
def test_flashinfer_matches_torch_backend(mode: str, triton: bool, paged_extend: bool, kv: str) -> None:
    """Each mode against the reference, over a bf16 pool and an FP8 one (the reference
    reads the same FP8 values; new tokens' K/V reach the ragged kernel in bf16). A mixed
    batch's last rows are decode rows (one token over a context); its extend rows have
    cached prefixes or not. With paged_extend an extend with prefixes, or a mixed batch, is
    one paged prefill; else ragged + paged + merge, and a mixed batch's decode rows run
    through FlashInfer's decode kernel or sgl's Triton one."""
    from sgl.kernels.attention import AttnMetadata
    from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend
    from sgl.kernels.torch_attention import TorchAttentionBackend

    torch.manual_seed(0)
    dev, dt, hq, hkv, d = torch.device("cuda"), torch.bfloat16, 16, 8, 128
    slots = 4096
    k_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt).to(KV_DTYPES[kv])
    v_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt).to(KV_DTYPES[kv])
    rng = random.Random(0)
    b = 7
    extends = 3 if mode.startswith("mixed") else b  # a mixed batch's rows from 3 on are decode rows
    prefix = [0] * b if mode == "extend" else [rng.randint(1, 300) for _ in range(b)]
    if mode in ("extend_prefix", "mixed_prefix"):
        prefix[2] = 0  # a request without a prefix among ones with
    if mode == "mixed":
        prefix[:extends] = [0] * extends
    new = [1] * b if mode == "decode" else [rng.randint(1, 200) for _ in range(b)]
    new[extends:] = [1] * (b - extends)
    kv_lens = [p + n for p, n in zip(prefix, new)]
    perm = torch.randperm(slots, device=dev)[: sum(kv_lens)] + 1
    kv_indices = perm.to(torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    # New tokens sit at the end of each request's KV; their K/V are in the pool already.
    new_slots = torch.cat([kv_indices[kv_indptr[i + 1] - new[i] : kv_indptr[i + 1]] for i in range(b)]).long()
    pre_idx = [kv_indices[kv_indptr[i] : kv_indptr[i] + prefix[i]] for i in range(b)]
    meta = AttnMetadata(mode == "decode", qo_indptr.to(dev), kv_indptr.to(dev), kv_indices, new, kv_lens,
                        kv_indptr.pin_memory(), qo_indptr.pin_memory())
    if mode in ("extend_prefix", "mixed_prefix"):
        meta.prefix_indptr_host = torch.tensor([0, *torch.tensor(prefix[:extends]).cumsum(0).tolist()],
                                               dtype=torch.int32).pin_memory()
        meta.prefix_indices = torch.cat(pre_idx[:extends])
    q = torch.randn(sum(new), hq, d, device=dev, dtype=dt)
    k, v = k_cache[new_slots].to(dt), v_cache[new_slots].to(dt)
    ref = TorchAttentionBackend()
    ref.begin_forward(meta)
    expected = ref.forward(q.float(), k, v, k_cache.float(), v_cache.float(), d**-0.5)
    fi = FlashInferAttentionBackend(hq, hkv, d, dt, dev, slots + 1, kv_dtype=KV_DTYPES[kv], triton_decode=triton,
                                    paged_extend_max_tokens=10**6 if paged_extend else 0)
    if mode.startswith("mixed"):
        meta.decode_from = extends
    fi.begin_forward(meta)
    got = fi.forward(q, k, v, k_cache, v_cache, d**-0.5)
    assert got.shape == expected.shape
    assert _rel_err(got, expected) < 1e-2
    if mode.startswith("mixed"):  # each part as accurate as the whole: the decode rows are few
        t = sum(new[:extends])
        assert _rel_err(got[t:], expected[t:]) < 1e-2


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("mode", ["decode", "extend", "extend_prefix", "mixed", "mixed_prefix", "cascade",
                                  "mixed_cascade"])
def test_flashinfer_on_the_cpu_tests_batches(mode: str, triton: bool) -> None:
    """The batches tests/test_flashinfer_backend_cpu.py runs through a stand-in for
    FlashInfer (tests/attn_batches.py), through FlashInfer itself and sgl's compiled Triton
    decode kernel: eight of each shape against the torch reference, bf16 (extends with
    cached prefixes as one paged prefill in even ones, as ragged + paged + merge in odd)."""
    from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend
    from sgl.kernels.torch_attention import TorchAttentionBackend
    from tests.attn_batches import batch, on_device

    dev, dt, hq, hkv, d, slots = torch.device("cuda"), torch.bfloat16, 16, 8, 128, 1000
    g = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt, generator=g)
    v_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt, generator=g)
    fi = FlashInferAttentionBackend(hq, hkv, d, dt, dev, slots + 1, triton_decode=triton)
    for seed in range(8):
        fi.paged_extend_max_tokens = 0 if seed % 2 else 10**6
        meta, new_slots = batch(mode, random.Random(seed), slots)
        meta = on_device(meta, dev)
        q = torch.randn(len(new_slots), hq, d, device=dev, dtype=dt, generator=g)
        k, v = k_cache[new_slots], v_cache[new_slots]
        ref = TorchAttentionBackend()
        ref.begin_forward(meta)
        expected = ref.forward(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), d**-0.5)
        fi.begin_forward(meta)
        got = fi.forward(q, k, v, k_cache, v_cache, d**-0.5)
        assert got.shape == expected.shape
        assert _rel_err(got, expected) < 1e-2, (mode, seed)


@pytest.mark.parametrize("paged_extend", [False, True])
@pytest.mark.parametrize("mode", ["extend", "extend_prefix", "mixed", "mixed_prefix", "mixed_cascade"])
def test_flashinfer_extend_plans_never_wait_for_the_gpu(mode: str, paged_extend: bool) -> None:
    """The overlap loop plans the next batch while the last one's forward runs: an
    extend's plans (and a mixed batch's, its decode rows in the paged prefill, on the Triton
    kernel or as a cascade) must queue their copies behind that work, never wait for it. Planned behind
    a kernel that keeps the GPU busy for a good fraction of a second, begin_forward
    returns long before it ends. (FlashInfer's eager decode plan copies from pageable
    memory of its own and waits: see sgl.kernels.flashinfer_attention.)"""
    import time

    from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend
    from tests.attn_batches import batch, on_device

    dev, dt, hq, hkv, d, slots = torch.device("cuda"), torch.bfloat16, 16, 8, 128, 1000
    fi = FlashInferAttentionBackend(hq, hkv, d, dt, dev, slots + 1, triton_decode=True,
                                    paged_extend_max_tokens=10**6 if paged_extend else 0)
    meta = on_device(batch(mode, random.Random(1), slots)[0], dev)
    fi.begin_forward(meta)  # the first plan's one-off set-up
    torch.cuda.synchronize()
    busy = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    busy[0].record()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU clock cycles
    busy[1].record()
    t = time.perf_counter()
    fi.begin_forward(meta)
    planned = time.perf_counter() - t
    torch.cuda.synchronize()
    gpu = busy[0].elapsed_time(busy[1]) / 1e3
    assert gpu > 0.1, gpu  # the kernel did keep the GPU busy
    assert planned < gpu / 4, (planned, gpu)


def test_flashinfer_cascade_matches_torch_backend() -> None:
    """Decode with a prefix shared by the whole batch: FlashInfer's shared block +
    per-request decode + merge against the torch reference, and against FlashInfer's
    own plain decode over the full KV."""
    from sgl.kernels.attention import AttnMetadata, CascadeMeta
    from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend
    from sgl.kernels.torch_attention import TorchAttentionBackend

    torch.manual_seed(0)
    dev, dt, hq, hkv, d = torch.device("cuda"), torch.bfloat16, 16, 8, 128
    slots, b, p = 8192, 9, 700
    k_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt)
    v_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt)
    rng = random.Random(0)
    own = [rng.randint(1, 200) for _ in range(b)]
    perm = (torch.randperm(slots, device=dev)[: p + sum(own)] + 1).to(torch.int32)
    shared, rest = perm[:p], perm[p:]
    own_indptr = torch.tensor([0, *torch.tensor(own).cumsum(0).tolist()], dtype=torch.int32)
    full = torch.cat([torch.cat([shared, rest[own_indptr[i] : own_indptr[i + 1]]]) for i in range(b)])
    kv_lens = [p + n for n in own]
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32)
    q = torch.randn(b, hq, d, device=dev, dtype=dt)
    new_slots = rest[own_indptr[1:] - 1].long()
    k, v = k_cache[new_slots], v_cache[new_slots]

    def meta(cascade: bool) -> AttnMetadata:
        m = AttnMetadata(True, qo_indptr.to(dev), kv_indptr.to(dev), full, [1] * b, kv_lens,
                         kv_indptr.pin_memory(), qo_indptr.pin_memory())
        if cascade:
            m.kv_indices = full[:0]
            m.cascade = CascadeMeta(p, shared, own_indptr.pin_memory(), rest)
        return m

    ref = TorchAttentionBackend()
    ref.begin_forward(meta(cascade=True))
    expected = ref.forward(q.float(), k, v, k_cache.float(), v_cache.float(), d**-0.5)
    plain_ref = TorchAttentionBackend()
    plain_ref.begin_forward(meta(cascade=False))
    assert torch.equal(plain_ref.forward(q.float(), k, v, k_cache.float(), v_cache.float(), d**-0.5), expected)
    fi = FlashInferAttentionBackend(hq, hkv, d, dt, dev, slots + 1)
    fi.begin_forward(meta(cascade=True))
    got = fi.forward(q, k, v, k_cache, v_cache, d**-0.5)
    fi.begin_forward(meta(cascade=False))
    plain = fi.forward(q, k, v, k_cache, v_cache, d**-0.5)
    assert _rel_err(got, expected) < 1e-2
    assert _rel_err(got, plain) < 1e-2


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize(("bs", "tc", "triton"), [(8, False, False), (64, False, False), (64, True, False),
                                                  (8, False, True), (64, False, True)])
def test_decode_graph_replanned_after_capture_matches_torch(bs: int, tc: bool, triton: bool, kv: str) -> None:
    """A decode graph captured under one plan and replayed under others (contexts of 1 to
    1,500 slots, so FlashInfer splits the long rows' KV), with two query heads per KV
    head, below and above tensor_core_min_batch (32): the decode kernel alone at 8 rows,
    both kernels at 64, each against the torch reference; and sgl's Triton kernel
    (triton_decode) at both sizes, whose graph reads the indptr and indices written
    before each replay."""
    from sgl.kernels.attention import AttnMetadata
    from sgl.kernels.flashinfer_attention import FlashInferAttentionBackend
    from sgl.kernels.torch_attention import TorchAttentionBackend

    torch.manual_seed(0)
    dev, dt, hq, hkv, d = torch.device("cuda"), torch.bfloat16, 16, 8, 128
    slots = 64 * 1500
    k_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt).to(KV_DTYPES[kv])
    v_cache = torch.randn(slots + 1, hkv, d, device=dev, dtype=dt).to(KV_DTYPES[kv])
    fi = FlashInferAttentionBackend(hq, hkv, d, dt, dev, slots + 1, context_length=2048, tensor_core_min_batch=32,
                                    kv_dtype=KV_DTYPES[kv], triton_decode=triton)
    fi.init_graph(bs, cascade=False)
    if triton:
        assert fi.decode_kernels(bs) == (False,) and not fi.graph_decode  # no FlashInfer wrapper without cascade
    else:
        assert fi.decode_kernels(bs) == ((False, True) if bs >= 32 else (False,))
        assert fi.graph_decode[(bs, tc)].use_tensor_cores == tc  # type: ignore[attr-defined]
    q = torch.zeros(bs, hq, d, device=dev, dtype=dt)
    fi.begin_graph_decode(bs, torch.arange(bs + 1, dtype=torch.int32).pin_memory(),
                          torch.zeros(bs, dtype=torch.int32, device=dev), tc)
    for _ in range(2):
        fi.forward(q, q[:, :hkv], q[:, :hkv], k_cache, v_cache, d**-0.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi.forward(q, q[:, :hkv], q[:, :hkv], k_cache, v_cache, d**-0.5)
    rng = random.Random(bs)
    for _ in range(3):
        kv_lens = [rng.choice([1, rng.randint(2, 100), rng.randint(100, 1500)]) for _ in range(bs)]
        kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
        kv_indices = (torch.randperm(slots, device=dev)[: sum(kv_lens)] + 1).to(torch.int32)
        q.copy_(torch.randn(bs, hq, d, device=dev, dtype=dt))
        fi.begin_graph_decode(bs, kv_indptr.pin_memory(), kv_indices, tc)
        graph.replay()
        last = kv_indices[kv_indptr[1:].long() - 1].long()
        ref = TorchAttentionBackend()
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
        ref.begin_forward(AttnMetadata(True, qo_indptr.to(dev), kv_indptr.to(dev), kv_indices, [1] * bs, kv_lens,
                                       kv_indptr, qo_indptr))
        expected = ref.forward(q.float(), k_cache[last].float(), v_cache[last].float(), k_cache.float(),
                               v_cache.float(), d**-0.5)
        assert _rel_err(out, expected) < 1e-2


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("gpu"), "qwen3", vocab=2048, hidden_size=256, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=512)


@pytest.fixture(scope="module")
def qwen3_g2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two query heads per KV head (as Qwen3-0.6B): tensor-core decode only from
    tensor_core_decode_min_batch rows, so graphs of one engine mix both kernels."""
    return tiny_model_dir(tmp_path_factory.mktemp("gpu-g2"), "qwen3", vocab=2048, hidden_size=256,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                          intermediate_size=512)


def _run(model_dir: str, prompts: list[list[int]], **kw: object) -> list[list[int]]:
    with sgl.Engine(model_dir, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16",
                    max_total_tokens=20000, **kw) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 24,
                                                              "ignore_eos": True})
        # Same prompts again: prefix-cached extends through ragged + paged + merge.
        again = e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 24,
                                                               "ignore_eos": True})
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
        info = e.get_server_info()
        assert_kv_balanced(info)
        # The GPU timeline: decode steps are part of all batches, and 24-token outputs decode.
        assert 0 < info["gpu_decode_busy_s"] <= info["gpu_busy_s"]
        assert 0 <= info["gpu_decode_idle_s"] <= info["gpu_idle_s"]
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("decode", ["triton", "flashinfer"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_cuda_graph_replay_equals_eager(qwen3_dir: str, kv: str, decode: str) -> None:
    """Decode graphs run decode's kernels as the eager forward does: the same tokens. The
    fresh prompts take the prefill pieces, whose attention is the eager forward's (a
    whole-forward graph takes prefix-cached prompts only)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2000) for _ in range(rng.randint(3, 80))] for _ in range(5)]
    kw = dict(attention_backend="flashinfer", kv_cache_dtype=kv, decode_attention_backend=decode)
    eager = _run(qwen3_dir, prompts, disable_cuda_graph=True, **kw)
    graphs = _run(qwen3_dir, prompts, cuda_graph_max_bs=8, **kw)
    assert graphs == eager


def _mixed_against_separate(model_dir: str, decode: str, shared: list[int], prompts: list[list[int]],
                            chunk: int) -> tuple[dict, dict]:
    """The same requests with mixed batches and without (flashinfer attention, `decode`'s
    kernel, CUDA graphs and the overlap loop, `shared` cached first): each request's top
    logprobs agree to bf16's precision up to its first near-tie flip; each engine's info."""
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}

    def run(mixed: bool) -> tuple[list[dict], dict]:
        with sgl.Engine(model_dir, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16",
                        attention_backend="flashinfer", decode_attention_backend=decode, max_total_tokens=20000,
                        chunked_prefill_size=chunk, enable_mixed_chunk=mixed) as e:
            return generate_after_prefix(e, shared, prompts, params)

    (mixed, info), (alone, alone_info) = run(True), run(False)
    assert_top_logprobs_agree(mixed, alone, tol=0.05)
    return info, alone_info


@pytest.mark.parametrize("paged_extend", [True, False])
@pytest.mark.parametrize("decode", ["triton", "flashinfer"])
def test_mixed_batches_agree_with_separate_forwards(qwen3_dir: str, decode: str, paged_extend: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """enable_mixed_chunk: prompt chunks share their forward with the running requests'
    next tokens, whose attention runs with the chunks' in one paged prefill
    (`paged_extend`, these chunks being under its threshold) or through the decode kernel
    (either one), prompt chunks with cached prefixes among them; against the same requests
    without mixed batches."""
    if not paged_extend:
        from sgl.sched.runner.model_runner import ModelRunner

        make = ModelRunner._attention_backend

        def split(self: ModelRunner, args: sgl.ServerArgs, m: object) -> object:
            backend = make(self, args, m)  # type: ignore[arg-type]
            backend.paged_extend_max_tokens = 0  # type: ignore[attr-defined]
            return backend

        monkeypatch.setattr(ModelRunner, "_attention_backend", split)
    rng = random.Random(5)
    shared = [rng.randrange(2000) for _ in range(200)]
    prompts = ([[rng.randrange(2000) for _ in range(n)] for n in (5, 20, 300, 700, 40, 900)]
               + [shared + [rng.randrange(2000) for _ in range(n)] for n in (3, 150, 400)])
    info, alone_info = _mixed_against_separate(qwen3_dir, decode, shared, prompts, chunk=128)
    assert info["mixed_steps"] > 0 and alone_info["mixed_steps"] == 0


@pytest.mark.parametrize("decode", ["triton", "flashinfer"])
def test_mixed_batches_keep_the_cascade_of_a_shared_prefix(qwen3_dir: str, decode: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that share a cached prefix and another's long prompt in chunks: with mixed
    batches the sharing rows ride the chunks as a cascade (the threshold lowered so that
    these few rows take one; on the CPU, 15 of 16 mixed forwards), without them they decode
    once the chunks are done; against the same requests without mixed batches."""
    from sgl.sched.runner import prepare as prep

    monkeypatch.setattr(prep, "CASCADE_MIN_SAVED_TOKENS", 1)
    rng = random.Random(8)
    shared = [rng.randrange(2000) for _ in range(200)]
    prompts = ([shared + [rng.randrange(2000) for _ in range(n)] for n in (3, 9, 17, 30)]
               + [[rng.randrange(2000) for _ in range(900)]])
    info, alone_info = _mixed_against_separate(qwen3_dir, decode, shared, prompts, chunk=64)
    assert info["mixed_steps"] > 0 and info["cascade_steps"] > 0 and alone_info["mixed_steps"] == 0


def test_triton_decode_agrees_with_flashinfer_decode(qwen3_g2_dir: str) -> None:
    """The same engine with either decode kernel, under CUDA graphs: the engine reports
    its kernel, and up to the first token where bf16 near-ties flip the two runs' top
    logprobs agree (the kernels sum in different orders)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2000) for _ in range(rng.randint(3, 400))] for _ in range(12)]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}

    def run(decode: str) -> list[dict]:
        with sgl.Engine(qwen3_g2_dir, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16",
                        attention_backend="flashinfer", max_total_tokens=20000, cuda_graph_max_bs=16,
                        decode_attention_backend=decode) as e:
            assert e.get_server_info()["decode_attention"] == decode
            outs = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
            assert_kv_balanced(e.get_server_info())
        return outs

    assert assert_top_logprobs_agree(run("triton"), run("flashinfer")) <= 3  # most rows agree token for token


@pytest.mark.parametrize("lengths", ["mixed", "uniform"])
def test_tensor_core_decode_graphs_equal_eager(qwen3_g2_dir: str, lengths: str) -> None:
    """Both decode kernels from 4 rows on a model with two query heads per KV head: five
    prompts of mixed lengths pick the tensor-core kernel, of one length the decode
    kernel; the 5-row batch replays the 8-row graph of that kernel, eager runs the
    eager wrapper of it, and both give the same tokens."""
    from sgl.kernels.flashinfer_attention import prefers_tensor_cores

    rng = random.Random(1)
    sizes = [rng.randint(3, 300) for _ in range(5)] if lengths == "mixed" else [120] * 5
    prompts = [[rng.randrange(2000) for _ in range(n)] for n in sizes]
    indptr = torch.tensor([0, *sizes]).cumsum(0)
    assert prefers_tensor_cores(indptr, 0) == (lengths == "mixed")
    kw = dict(attention_backend="flashinfer", decode_attention_backend="flashinfer", tensor_core_decode_min_batch=4)
    eager = _run(qwen3_g2_dir, prompts, disable_cuda_graph=True, **kw)
    graphs = _run(qwen3_g2_dir, prompts, cuda_graph_max_bs=8, **kw)
    assert graphs == eager


@pytest.mark.parametrize(("model", "decode"), [("qwen3_dir", "triton"), ("qwen3_g2_dir", "triton"),
                                               ("qwen3_g2_dir", "flashinfer")])
def test_cascade_under_cuda_graphs_equals_plain_decode(model: str, decode: str, request: pytest.FixtureRequest,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Cascade decode replayed from its CUDA graphs (padded sizes included), on by
    default with flashinfer, gives the tokens of cascade run eagerly; against plain decode
    (other kernels, summing in other orders) every step's top logprobs agree to bf16's
    precision up to a request's first near-tie flip, and most requests agree token for token.
    The cascade graphs' suffixes run FlashInfer's decode kernel; plain decode runs the
    Triton kernel, or (two query heads per KV head, both FlashInfer kernels from 4 rows)
    either of FlashInfer's. Without the overlap loop: with it, which requests share a
    request's first decode steps depends on when their messages arrive (a request joins
    decode as its prefill is launched), and bf16 forwards of different batches part at near
    ties (on the CPU in bf16, this shape's request 0 decoding alone for a step takes other
    tokens than in the batch of six)."""
    qwen3_dir = request.getfixturevalue(model)
    from sgl.sched.runner import prefill_graph, prepare

    monkeypatch.setattr(prepare, "CASCADE_MIN_SAVED_TOKENS", 1)
    rng = random.Random(2)
    shared = [rng.randrange(2000) for _ in range(300)]
    prompts = [shared + [rng.randrange(2000) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}

    def run(**kw: object) -> tuple[list[dict], int]:
        with sgl.Engine(qwen3_dir, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16",
                        attention_backend="flashinfer", max_total_tokens=20000, cuda_graph_max_bs=8,
                        tensor_core_decode_min_batch=4, decode_attention_backend=decode,
                        disable_overlap_schedule=True, **kw) as e:
            e.generate(input_ids=prompts[0], sampling_params=params)  # caches the shared prefix first
            outs = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
            info = e.get_server_info()
            assert_kv_balanced(info)
        return outs, info["cascade_steps"]

    # Prompts through the pieces in every run, whose attention is the eager run's: the cached
    # prefix's turns would take a whole-forward graph, planned for its largest batch (rounds
    # apart), and the runs are to differ in their decode attention only.
    monkeypatch.setattr(prefill_graph, "WHOLE_MAX_TOKENS", 0)
    plain, plain_steps = run(enable_cascade_attention=False)
    graphs, steps = run()
    eager, eager_steps = run(enable_cascade_attention=True, disable_cuda_graph=True)
    assert plain_steps == 0 and steps > 0 and eager_steps > 0
    assert [o["output_ids"] for o in graphs] == [o["output_ids"] for o in eager]
    assert assert_top_logprobs_agree(graphs, plain) <= 1


def test_graph_decode_of_a_shared_prefix_past_the_pool(qwen3_dir: str) -> None:
    """64 requests on a cached 1,000-token prefix plus one unrelated one (no common
    prefix: plain decode, no cascade) in a pool of 20,000 slots: a decode batch's KV
    indices count the prefix once per request, ~65,000 of them, past the pool. The
    CUDA-graph index buffer was sized by the pool and FlashInfer's plan raised "The
    size of indices should be less than or equal to the allocated buffer", killing the
    scheduler; sized for the captured batch times the context, all finish and agree
    with eager decode."""
    rng = random.Random(7)
    prefix = [rng.randrange(2000) for _ in range(1000)]
    prompts = [prefix + [rng.randrange(2000) for _ in range(4)] for _ in range(64)]
    prompts.append([rng.randrange(2000) for _ in range(30)])
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def run(**kw: object) -> list[dict]:
        with sgl.Engine(qwen3_dir, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16",
                        attention_backend="flashinfer", max_total_tokens=20000, **kw) as e:
            e.generate(input_ids=prefix + [1], sampling_params=params)  # caches the prefix
            outs = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
            info = e.get_server_info()
            assert_kv_balanced(info)
            assert info["failures"] == 0
        assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 8} for o in outs)
        return outs

    # Graphs and eager split the KV reads differently, and this random model's logits are
    # nearly flat over 1,000 positions: bf16 near-ties may flip. Up to the first flip the
    # contexts are equal, and so must be each step's top logprobs.
    assert_top_logprobs_agree(run(), run(disable_cuda_graph=True))


def test_prefill_graphs_equal_the_eager_forward(qwen3_dir: str) -> None:
    """Extend batches through the captured graphs (sgl.sched.runner.prefill_graph), padded
    to the captured token counts, against the eager forward: prompts from 1 token past
    the largest count (eager there), fresh and prefix-cached, with prompt logprobs; the
    prefix-cached batch of 6 through a whole-forward graph (its attention planned into
    FlashInfer's graph-mode wrapper, requests padded with empty ones), the fresh prompts
    and a batch of 10 through the pieces. Up to the first greedy flip (the GEMMs may pick
    another algorithm for the padded row count) every prompt and output logprob agrees to
    bf16's precision."""
    rng = random.Random(11)
    prefix = [rng.randrange(2000) for _ in range(100)]
    prompts = ([[rng.randrange(2000) for _ in range(n)] for n in (1, 15, 16, 17, 100, 255, 256, 257, 600)]
               + [prefix + [rng.randrange(2000) for _ in range(rng.randint(1, 40))] for _ in range(6)]
               + [[rng.randrange(2000) for _ in range(rng.randint(1, 20))] for _ in range(10)])
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def run(**kw: object) -> tuple[list[dict], dict]:
        with sgl.Engine(qwen3_dir, transport="inproc", skip_tokenizer_init=True, dtype="bfloat16",
                        attention_backend="flashinfer", max_total_tokens=20000, chunked_prefill_size=512,
                        **kw) as e:
            e.generate(input_ids=prefix + [1], sampling_params=params)  # caches the prefix
            outs = [e.generate(input_ids=p, sampling_params=params, return_logprob=True, logprob_start_len=0)
                    for p in prompts[:9]]  # one at a time: each its own padded count
            for batch in (prompts[9:15], prompts[15:]):
                outs += e.generate(input_ids=batch, sampling_params=params, return_logprob=True,
                                   logprob_start_len=0)
            info = e.get_server_info()
            assert_kv_balanced(info)
        return outs, info

    graphed, info = run(piecewise_cuda_graph_max_tokens=256)
    eager, eager_info = run(disable_cuda_graph=True)
    assert info["prefill_graph_steps"] > info["prefill_whole_graph_steps"] > 0, info
    assert eager_info["prefill_graph_steps"] == 0
    for g, e in zip(graphed, eager):
        gi, ei = ([lp for lp, *_ in o["meta_info"]["input_token_logprobs"][1:]] for o in (g, e))
        assert max((abs(x - y) for x, y in zip(gi, ei)), default=0.0) < 0.05
        for j, (a, b) in enumerate(zip(g["output_ids"], e["output_ids"])):
            lg, le = (o["meta_info"]["output_token_logprobs"][j][0] for o in (g, e))
            assert abs(lg - le) < 0.05, (j, lg, le)
            if a != b:
                break


def test_flashinfer_layer_kernels_match_torch() -> None:
    from sgl.kernels import layers

    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(37, 1024, device=dev)
    res = torch.randn(37, 1024, device=dev)
    w = torch.rand(1024, device=dev) + 0.5
    # float32 tensors take the torch path; bfloat16 ones the FlashInfer kernels.
    assert _rel_err(layers.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6), layers.rms_norm(x, w, 1e-6)) < 1e-2
    n_ref, r_ref = layers.add_rms_norm(x, res, w, 1e-6)
    n_fi, r_fi = layers.add_rms_norm(x.bfloat16(), res.bfloat16(), w.bfloat16(), 1e-6)
    assert _rel_err(n_fi, n_ref) < 1e-2 and _rel_err(r_fi, r_ref) < 1e-2
    # Per-head q/k norm on a strided view of a fused qkv row, as the model calls it.
    qkv = torch.randn(37, 4096, device=dev)
    wh = torch.rand(128, device=dev) + 0.5
    view = qkv.bfloat16()[:, 2048:3072].view(37, 8, 128)
    assert not view.is_contiguous()
    ref = layers.rms_norm(qkv[:, 2048:3072].view(37, 8, 128), wh, 1e-6)
    assert _rel_err(layers.rms_norm(view, wh.bfloat16(), 1e-6), ref) < 1e-2
    gu = torch.randn(37, 2 * 3072, device=dev)
    assert _rel_err(layers.silu_and_mul(gu.bfloat16()), layers.silu_and_mul(gu)) < 1e-2
    rope = layers.rope_tables(128, 4096, 1e6, None, dev)
    q, k = torch.randn(37, 16, 128, device=dev), torch.randn(37, 8, 128, device=dev)
    pos = torch.randint(0, 4096, (37,), device=dev)
    q_ref, k_ref = layers.apply_rope(q, k, pos, rope)
    q_fi, k_fi = layers.apply_rope(q.bfloat16(), k.bfloat16(), pos, rope)
    assert _rel_err(q_fi, q_ref) < 1e-2 and _rel_err(k_fi, k_ref) < 1e-2


@pytest.mark.parametrize("pool", ["bf16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(("hq", "hkv", "d", "norm"), [(16, 8, 128, True), (32, 8, 128, True), (6, 2, 80, True),
                                                      (8, 2, 64, False)])
def test_norm_rope_store_equals_the_separate_kernels(hq: int, hkv: int, d: int, norm: bool, pool: str) -> None:
    """The fused norm + rotary + KV write against the separate ops it replaces, in
    float32 (the torch reference path): q and k within a bf16 rounding, the pool holding
    exactly the returned k (cast into the pool, FP8 clamped first: inputs reach past
    e4m3's 448) and v, and no other slot touched. (Not FlashInfer's kernels as reference:
    at head_dim 80 they and this kernel gave values 7.6 apart on an H200 (2026-12-02),
    while on the CPU, Triton's interpreter, this kernel matched the float32 path.)"""
    from sgl.cache.kv_write import write_kv
    from sgl.kernels.layers import rope_tables
    from sgl.kernels.norm_rope_store import norm_rope_store
    from tests.kernel_refs import norm_rope_reference

    torch.manual_seed(0)
    dev, dt, t = torch.device("cuda"), torch.bfloat16, 300
    pool_dt = {"bf16": dt, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[pool]
    rope = rope_tables(d, 8192, 1e6, None, dev)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dt) * 4
    qkv[:, (hq + hkv) * d:] *= 200  # v past e4m3's range
    qw = (torch.rand(d, device=dev) + 0.5).to(dt) if norm else None
    kw = (torch.rand(d, device=dev) + 0.5).to(dt) if norm else None
    pos = torch.randint(0, 8000, (t,), device=dev)
    loc = torch.randperm(2 * t, device=dev)[:t] + 1
    k_buf = torch.randn(2 * t + 1, hkv, d, device=dev, dtype=dt).to(pool_dt)
    v_buf = torch.randn(2 * t + 1, hkv, d, device=dev, dtype=dt).to(pool_dt)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    q0, k0, v0 = norm_rope_reference(qkv, hq, hkv, d, qw, kw, 1e-6, pos, rope)
    q, k, v = norm_rope_store(qkv, hq, hkv, d, qw, kw, 1e-6, pos, rope.cos_sin, k_buf, v_buf, loc)
    for got, want in ((q, q0), (k, k0)):
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.allclose(got.float(), want, rtol=2**-7, atol=2**-6), (got.float() - want).abs().max()
    assert torch.equal(v.float(), v0)
    write_kv(k_ref, v_ref, loc, k, v)  # what the pool must hold: the returned k and v, cast into it
    assert torch.equal(k_buf.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_buf.view(torch.uint8), v_ref.view(torch.uint8))


def test_flashinfer_top_k_top_p_matches_torch() -> None:
    """Mixed per-row top_k / top_p, disabled rows included, on a Qwen-sized vocabulary:
    FlashInfer's renorm kernels keep the same tokens as the torch sort, with the same
    renormalised masses. Each top_p lies midway between two cumulative masses (and each
    k-th probability is strictly above the next), so no row sits on a documented tie or
    rounding boundary (kernels/sampling.py)."""
    from sgl.kernels.sampling import top_k_top_p

    g = torch.Generator().manual_seed(0)
    v = 151_936
    # (top_k, tokens top-p keeps); None: disabled (top_k = V, top_p = 1.0).
    rows = [(None, None), (50, None), (None, 200), (1000, 20), (20, 300), (None, 1), (2, None), (40, 45)]
    probs = torch.softmax(torch.randn(len(rows), v, generator=g, dtype=torch.float64) * 3, -1).float()
    cum = probs.double().sort(-1, descending=True).values.cumsum(-1)
    top_k = torch.tensor([k or v for k, _ in rows], dtype=torch.int64)
    # Keeping j tokens: the mass before token j-1 is < top_p <= the mass through it.
    top_p = torch.tensor([1.0 if j is None else ((cum[i, j - 2].item() if j > 1 else 0.0) + cum[i, j - 1].item()) / 2
                          for i, (_, j) in enumerate(rows)], dtype=torch.float32)
    for i, (k, _) in enumerate(rows):
        if k is not None:
            s = probs[i].sort(descending=True).values
            assert s[k - 1] > s[k]

    ref = top_k_top_p(probs, top_k, top_p)  # CPU: the torch sort
    assert (ref > 0).sum(-1).tolist() == [min(k or v, j or v) for k, j in rows]
    got = top_k_top_p(probs.cuda(), top_k.cuda(), top_p.cuda()).cpu()
    assert got.dtype == torch.float32 and got.shape == probs.shape
    assert torch.equal(got > 0, ref > 0)
    ref = ref.double() / ref.double().sum(-1, keepdim=True)
    assert (got.double() - ref).abs().max().item() < 1e-5


def test_flashinfer_top_k_top_p_keeps_boundary_ties() -> None:
    """The documented difference: FlashInfer keeps every token tied with the boundary
    probability, the torch sort keeps exactly k (or the exact top-p prefix)."""
    from sgl.kernels.sampling import top_k_top_p

    row = [0.5, 0.125, 0.125, 0.125, 0.0625, 0.0625, 0.0, 0.0]  # exact in float32; sums to 1
    probs = torch.tensor([row, row])
    top_k = torch.tensor([2, len(row)], dtype=torch.int64)
    top_p = torch.tensor([1.0, 0.6], dtype=torch.float32)  # row 1: the mass before token 2 is 0.625 >= 0.6
    ref = top_k_top_p(probs, top_k, top_p)
    got = top_k_top_p(probs.cuda(), top_k.cuda(), top_p.cuda()).cpu()
    assert (ref > 0).sum(-1).tolist() == [2, 2]
    assert (got > 0).sum(-1).tolist() == [4, 4]
    assert torch.equal(got > 0, probs >= 0.125)
    assert torch.allclose(got, torch.where(probs >= 0.125, probs / 0.875, 0.0))


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_draw_samples_the_sampler_distribution(filtered: bool, dtype: torch.dtype) -> None:
    """The fused draw (kernels/sampling.FusedDraw: sgl's Gumbel-max kernel unfiltered,
    FlashInfer's filtered), which the sampler takes on a GPU for rows without their own
    seed, draws from softmax(logits / T) filtered as top_k_top_p keeps it: 20,000 draws of
    one distribution over 8 tokens (a 40,000-id row, five of the kernel's chunks, with mass on 8, T = 0.7) against
    the exact probabilities, within 5 standard errors each; a filtered-out token is never
    drawn; greedy rows in the same batch take the argmax; its stream moves on (a second
    draw differs) and restarts with its seed (a new FusedDraw of the same seed draws the
    same)."""
    from sgl.kernels.sampling import FusedDraw, top_k_top_p

    draw = FusedDraw(torch.device("cuda"), 0)
    v, draws, t = 40_000, 20_000, 0.7
    base = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    logits = torch.full((draws + 2, v), -1e9, dtype=dtype)
    logits[:, 30_000:30_008] = base.to(dtype)  # in the middle of a row: not the first chunk's ids
    logits[draws:, 30_003] = 9.0  # two greedy rows, whose argmax is not the most likely draw
    logits = logits.cuda()
    temperature = torch.full((draws + 2, 1), t, device="cuda")
    greedy = torch.zeros(draws + 2, dtype=torch.bool, device="cuda")
    greedy[draws:] = True
    top_k = torch.full((draws + 2,), 5 if filtered else v, dtype=torch.int64, device="cuda")
    top_p = torch.full((draws + 2,), 0.9 if filtered else 1.0, device="cuda")
    args = (temperature, greedy, top_k, top_p, filtered, filtered)
    ids = draw(logits, *args)
    assert ids.dtype == torch.int64
    assert ids[draws:].tolist() == [30_003, 30_003]
    ids = ids[:draws]
    assert not torch.equal(draw(logits, *args)[:draws], ids)
    assert torch.equal(FusedDraw(torch.device("cuda"), 0)(logits, *args)[:draws], ids)
    row = logits[:1].float().cpu() / t
    want = top_k_top_p(torch.softmax(row, -1), top_k[:1].cpu(), top_p[:1].cpu(), filtered, filtered)[0]
    want = (want / want.sum())[30_000:30_008].double()
    counts = torch.bincount(ids.cpu(), minlength=v)
    got = counts[30_000:30_008].double() / draws
    assert int(counts.sum() - counts[30_000:30_008].sum()) == 0
    assert bool((got[want == 0] == 0).all())
    se = (want * (1 - want) / draws).sqrt()
    assert bool(((got - want).abs() <= 5 * se + 1e-9).all()), (got, want)


def test_gumbel_draw_greedy_rows_are_torch_argmax() -> None:
    """Greedy rows of the one-pass kernel equal torch.argmax exactly, ties included (the
    first index of the maximum), wherever the maximum falls among chunks and lanes."""
    from sgl.kernels.gumbel_draw import gumbel_draw

    g = torch.Generator().manual_seed(0)
    b, v = 64, 151_936
    logits = torch.randn(b, v, generator=g).to(torch.bfloat16)
    for i in range(b):  # ties at random ids, some in one chunk, some across chunks
        at = torch.randint(0, v, (1 + i % 4,), generator=g)
        logits[i, at] = 8.0
    logits = logits.cuda()
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    ids = gumbel_draw(logits, torch.ones(b, device="cuda"), torch.ones(b, dtype=torch.bool, device="cuda"), zero,
                      zero.clone())
    assert torch.equal(ids, logits.argmax(dim=-1))


def test_gumbel_draw_bitmask_equals_xgrammars_apply() -> None:
    """A grammar's bitmask applied in the one-pass draw (what the sampler does for grammar
    rows) picks, for greedy rows, the argmax of the logits masked by xgrammar's own apply
    on the GPU and cut at the tokenizer's width; sampled rows only ids the mask allows;
    a row with no mask row is not masked."""
    import xgrammar

    from sgl.kernels.gumbel_draw import Bitmask, gumbel_draw

    g = torch.Generator().manual_seed(1)
    b, v, width = 64, 151_936, 151_669  # Qwen3's columns and tokenizer ids
    logits = torch.randn(b, v, generator=g).to(torch.bfloat16).cuda()
    words = torch.randint(-(2**31), 2**31, (b, (width + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    words[:, :10] = 0  # the first 320 ids never allowed: the raw argmax is often one of them
    words = words.cuda()
    rows = torch.arange(b, dtype=torch.int32)
    rows[::5] = -1
    rows = rows.cuda()
    expected = logits.float()
    masked = (rows >= 0).nonzero()[:, 0]
    part = expected[masked].contiguous()
    xgrammar.apply_token_bitmask_inplace(part, words[masked].contiguous(), vocab_size=width)
    part[:, width:] = float("-inf")
    expected[masked] = part
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    mask = Bitmask(words, rows, width)
    ids = gumbel_draw(logits, torch.ones(b, device="cuda"), torch.ones(b, dtype=torch.bool, device="cuda"), zero,
                      zero.clone(), mask)
    assert torch.equal(ids, expected.argmax(dim=-1))
    ids = gumbel_draw(logits, torch.full((b,), 0.8, device="cuda"), None, zero, zero.clone(), mask)
    assert bool(torch.isfinite(expected.gather(1, ids[:, None])).all())
