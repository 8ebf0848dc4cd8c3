"""Embeddings (engine.encode, /v1/embeddings) against Hugging Face on tiny random
Qwen3 and Llama models saved with sentence-transformers' files (float32, CPU): the
vectors equal transformers' final hidden states pooled (last token or mean) and
normalised within 1e-5, through chunked prefill, with a warm radix cache, and batched
with generation requests in flight; the real openai client's embeddings.create
against `sgl serve` (float, base64, `dimensions` for a Matryoshka model and refused
for another); bad input is a 400 naming its field; the KV accounting balances."""

from __future__ import annotations

import base64
import json
import random
import shutil
import signal
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sgl
from tests.conftest import assert_kv_balanced, tiny_model_dir
from tests.serve_util import HTTP, ServerProc, openai_client

TOL = 1e-5
TOKENIZER_VOCAB = 49152  # the default model's tokenizer: text prompts over the serve tests
_rng = random.Random(7)
LONG = [_rng.randrange(1, 500) for _ in range(70)]  # over 16-token chunks: 5 chunks
PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [11, 2], LONG, [7]]


def sentence_transformers_dir(model_dir: str, mode: str, normalize: bool, **config: Any) -> str:
    """Add sentence-transformers' files to a model directory (and keys to its config.json)."""
    d = Path(model_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (d / "2_Normalize").mkdir(exist_ok=True)
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((d / "config.json").read_text())["hidden_size"]
    flags = {f"pooling_mode_{k}": False for k in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                                                    "weightedmean_tokens", "lasttoken")}
    flags["pooling_mode_lasttoken" if mode == "last" else "pooling_mode_mean_tokens"] = True
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, **flags,
                                                             "include_prompt": True}))
    if config:
        values = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**values, **config}))
    return model_dir


def reference(model_dir: str, ids: list[int], mode: str, normalize: bool) -> torch.Tensor:
    """transformers' base model's final hidden states, pooled and normalised as
    sentence-transformers' Pooling and Normalize modules do."""
    from transformers import AutoModel

    model = _hf_models.get(model_dir)
    if model is None:
        model = _hf_models[model_dir] = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = h[-1] if mode == "last" else h.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


_hf_models: dict[str, Any] = {}


def close(got: list[float], want: torch.Tensor) -> None:
    g = torch.tensor(got, dtype=torch.float32)
    assert g.shape == want.shape
    assert torch.allclose(g, want, atol=TOL, rtol=0), (g - want).abs().max().item()


CASES = {  # name: (arch, pooling, normalize)
    "qwen3-last-norm": ("qwen3", "last", True),
    "llama-mean-norm": ("llama", "mean", True),
    "qwen3-mean-raw": ("qwen3", "mean", False),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, bool]:
    arch, mode, normalize = CASES[request.param]
    d = tiny_model_dir(tmp_path_factory.mktemp(f"emb-{request.param}"), arch, vocab=512, seed=11)
    return sentence_transformers_dir(d, mode, normalize), mode, normalize


@pytest.fixture(scope="module")
def engine(case: tuple[str, str, bool]) -> Iterator[sgl.Engine]:
    e = sgl.Engine(case[0], transport="inproc", disable_overlap_schedule=False, skip_tokenizer_init=True,
                   dtype="float32", max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=16)
    yield e
    assert_kv_balanced(e.get_server_info())
    e.shutdown()


def test_encode_equals_the_reference(engine: sgl.Engine, case: tuple[str, str, bool]) -> None:
    d, mode, normalize = case
    assert engine.get_server_info()["embedding"]["pooling"] == mode
    outs = engine.encode(input_ids=PROMPTS)  # LONG goes through 5 chunks
    assert isinstance(outs, list) and len(outs) == len(PROMPTS)
    for out, ids in zip(outs, PROMPTS):
        close(out["embedding"], reference(d, ids, mode, normalize))
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["completion_tokens"] == 0
    one = engine.encode(input_ids=PROMPTS[0])
    assert isinstance(one, dict)
    close(one["embedding"], reference(d, PROMPTS[0], mode, normalize))


def test_encode_with_a_warm_radix_cache(engine: sgl.Engine, case: tuple[str, str, bool]) -> None:
    """A prompt whose prefix the tree holds (a generation put it there): last-token pooling
    reuses it, mean pooling recomputes it; both equal the reference."""
    d, mode, normalize = case
    engine.generate(input_ids=LONG[:50], sampling_params={"max_new_tokens": 4, "temperature": 0})
    out = engine.encode(input_ids=LONG)
    close(out["embedding"], reference(d, LONG, mode, normalize))  # type: ignore[call-overload]
    cached = out["meta_info"]["cached_tokens"]  # type: ignore[call-overload]
    assert cached == 0 if mode == "mean" else cached >= 48


def test_encode_batched_with_generation(engine: sgl.Engine, case: tuple[str, str, bool]) -> None:
    """Generations stream while embedding requests join the same prefill batches."""
    d, mode, normalize = case
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    gen_prompts = [[_rng.randrange(1, 500) for _ in range(n)] for n in (5, 6)]  # short: they share chunks
    alone = engine.generate(input_ids=gen_prompts, sampling_params=greedy)
    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        gen = pool.submit(engine.generate, input_ids=gen_prompts, sampling_params=greedy)
        encs = [f.result() for f in [pool.submit(engine.encode, input_ids=ids) for ids in PROMPTS]]
        gens = gen.result()
    assert [g["output_ids"] for g in gens] == [a["output_ids"] for a in alone]
    for out, ids in zip(encs, PROMPTS):
        close(out["embedding"], reference(d, ids, mode, normalize))


def test_encode_refuses_bad_input(engine: sgl.Engine) -> None:
    with pytest.raises(ValueError, match="^input_ids: empty input"):
        engine.encode(input_ids=[])
    with pytest.raises(ValueError, match=r"^input_ids\[1\]=512 is out of the vocabulary \(size 512\)"):
        engine.encode(input_ids=[1, 512])
    # In a batch the refusal names the prompt's position too.
    with pytest.raises(ValueError, match=r"^input_ids\[2\]\[0\]=512 is out of the vocabulary"):
        engine.encode(input_ids=[[1], [2, 3], [512]])
    with pytest.raises(ValueError, match=r"^input_ids\[1\]: empty input"):
        engine.encode(input_ids=[[1], []])
    with pytest.raises(ValueError, match="context length"):
        engine.encode(input_ids=[1] * 1024)
    with pytest.raises(ValueError, match="^dimensions=8 is invalid: this model does not support Matryoshka"):
        engine.encode(input_ids=[1, 2], dimensions=8)
    with pytest.raises(ValueError, match="^prompt: give exactly one of prompt or input_ids"):
        engine.encode(prompt=["a", "b"], input_ids=[[1], [2]])


def test_a_generation_model_serves_no_embeddings(tmp_path: Path) -> None:
    d = tiny_model_dir(tmp_path, "llama", vocab=128, seed=1)
    with sgl.Engine(d, transport="inproc", skip_tokenizer_init=True, dtype="float32", max_total_tokens=1024) as e:
        assert e.get_server_info()["embedding"] is None
        with pytest.raises(ValueError, match="^model: this model serves no embeddings"):
            e.encode(input_ids=[1, 2])
        assert e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"]


def test_is_embedding_forces_last_token_pooling(tmp_path: Path) -> None:
    d = tiny_model_dir(tmp_path, "qwen2", vocab=128, seed=2)
    with sgl.Engine(d, transport="inproc", skip_tokenizer_init=True, dtype="float32", max_total_tokens=1024,
                    is_embedding=True, pooling="mean") as e:
        info = e.get_server_info()["embedding"]
        assert (info["pooling"], info["normalize"]) == ("mean", True)
        close(e.encode(input_ids=[3, 4, 5])["embedding"], reference(d, [3, 4, 5], "mean", True))
        assert_kv_balanced(e.get_server_info())


# ---- over HTTP: the openai client against `sgl serve` -----------------------------------


def _with_tokenizer(d: str) -> str:
    from sgl.sched.models.default_model import default_model_dir

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(default_model_dir()) / name, Path(d) / name)
    return d


@pytest.fixture(scope="module")
def served_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("emb-serve")
    plain = _with_tokenizer(tiny_model_dir(base / "plain", "qwen3", vocab=TOKENIZER_VOCAB, seed=4,
                                           hidden_size=32, intermediate_size=64))
    mrl = _with_tokenizer(tiny_model_dir(base / "mrl", "qwen3", vocab=TOKENIZER_VOCAB, seed=5,
                                         hidden_size=32, intermediate_size=64))
    return {"plain": sentence_transformers_dir(plain, "last", True),
            "mrl": sentence_transformers_dir(mrl, "mean", True, is_matryoshka=True)}


@pytest.fixture(scope="module")
def server(served_dirs: dict[str, str]) -> Iterator[ServerProc]:
    s = ServerProc("--model-path", served_dirs["plain"], "--dtype", "float32", "--max-total-tokens", "2048",
                   "--context-length", "256", "--chunked-prefill-size", "16", "--served-model-name", "emb")
    yield s
    s.stop(signal.SIGTERM)


@pytest.fixture
def oai(server: ServerProc) -> Iterator[openai.OpenAI]:
    c = openai_client(server.url + "/v1", "none", max_retries=0, timeout=60)
    yield c
    c.close()
    server.assert_balanced()


def _ids(model_dir: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])


def test_openai_embeddings_float_and_base64(oai: openai.OpenAI, server: ServerProc,
                                            served_dirs: dict[str, str]) -> None:
    d = served_dirs["plain"]
    texts = ["The quick brown fox jumps over the lazy dog, again and again, until it tires.", "hello"]
    res = oai.embeddings.create(model="emb", input=texts, user="u1")
    assert [x.index for x in res.data] == [0, 1] and res.model == "emb"
    want = [reference(d, _ids(d, t), "last", True) for t in texts]
    for x, w in zip(res.data, want):
        close(x.embedding, w)
    n = sum(len(_ids(d, t)) for t in texts)
    assert (res.usage.prompt_tokens, res.usage.total_tokens) == (n, n)
    raw = HTTP.post(server.url + "/v1/embeddings", json={"input": texts[1], "encoding_format": "base64"},
                    timeout=60).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), want[1])
    # The openai client asks for base64 itself and decodes it: the same floats.
    close(oai.embeddings.create(model="emb", input=[_ids(d, texts[1])]).data[0].embedding, want[1])


def test_openai_embeddings_refusals(oai: openai.OpenAI) -> None:
    def refused(field: str, **kw: Any) -> str:
        with pytest.raises(openai.BadRequestError) as e:
            oai.embeddings.create(model="emb", **kw)
        body: Any = e.value.body
        assert body["param"] == field, body
        return str(body["message"])

    assert "Matryoshka" in refused("dimensions", input="hi", dimensions=8)
    refused("input", input="")
    refused("input", input=[])
    assert refused("input", input=[[1, 2], [TOKENIZER_VOCAB]]).startswith(f"input[1][0]={TOKENIZER_VOCAB} ")
    assert "context length" in refused("input", input=[[1] * 300])
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="other", input="hi")


def test_native_encode(server: ServerProc, served_dirs: dict[str, str]) -> None:
    d = served_dirs["plain"]
    out = HTTP.post(server.url + "/encode", json={"text": "hello there"}, timeout=60).json()
    close(out["embedding"], reference(d, _ids(d, "hello there"), "last", True))
    assert out["meta_info"]["prompt_tokens"] == len(_ids(d, "hello there"))


def test_openai_dimensions_of_a_matryoshka_model(served_dirs: dict[str, str]) -> None:
    d = served_dirs["mrl"]
    s = ServerProc("--model-path", d, "--dtype", "float32", "--max-total-tokens", "2048", "--chunked-prefill-size",
                   "16", "--served-model-name", "mrl")
    try:
        c = openai_client(s.url + "/v1", "none", max_retries=0, timeout=60)
        text = "Matryoshka dolls nest inside one another, each a little smaller than the last."
        full = reference(d, _ids(d, text), "mean", True)
        res = c.embeddings.create(model="mrl", input=text, dimensions=8)
        close(res.data[0].embedding, torch.nn.functional.normalize(full[:8], dim=0))
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            c.embeddings.create(model="mrl", input=text, dimensions=33)
        c.close()
        s.assert_balanced()
    finally:
        s.stop(signal.SIGTERM)


def test_http_error_names_the_field(server: ServerProc) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "encoding_format": "bits"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [1.5]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_pool_rows_sum_each_entrys_run(lengths: list[int], seed: int) -> None:
    """PoolRows sums each entry's run of rows (through differences of one float64 running
    sum, the same on every run on a GPU too) as a float64 sum of that run alone does, up to
    float32 rounding; the rows' magnitudes vary, as final-norm states' do."""
    from sgl.sched.models.forward_batch import PoolRows

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(sum(lengths), 8, generator=g) * torch.rand(sum(lengths), 1, generator=g) * 50
    last = torch.tensor(lengths).cumsum(0) - 1
    p = PoolRows(torch.arange(sum(lengths)), last)
    p.pool(hidden)
    want = torch.stack([run.double().sum(0) for run in hidden.split(lengths)])
    assert p.out is not None and p.out.dtype == torch.float32
    assert torch.allclose(p.out.double(), want, rtol=1e-6, atol=1e-5)
