"""LoRA adapters end to end on CPU in float32: outputs equal PEFT's merged model token
for token (greedy) with logprobs within 1e-4, for three random adapters of different
ranks and targets in one batch with base requests, on SmolLM2-135M and a tiny Qwen3;
after an unload and a reload; with beams and grammars (against an engine whose base is
the merged model; a tiny Llama with SmolLM2's tokenizer there and over HTTP); the radix
cache never shares a prefix across adapters; what is refused is refused with the
caller's field named and nothing changed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import torch

import sgl
from tests.conftest import other_rank_failed, tiny_model_dir
from tests.paged_driver import converted_default_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, targets, lora_alpha, use_rslora): three ranks, three target sets, rsLoRA once.
SPECS: dict[str, tuple[int, list[str], int, bool]] = {
    "qv4": (4, ["q_proj", "v_proj"], 8, False),
    "all8": (8, ALL, 16, False),
    "mlp16": (16, ["o_proj", "gate_proj", "up_proj", "down_proj"], 8, True),
}
NEW = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}


def make_adapter(model_dir: str, out: Path, rank: int, targets: list[str], alpha: int, rslora: bool,
                 seed: int) -> str:
    """A random PEFT adapter (A and B both random: every target changes the outputs)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                          use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(out)
    return str(out)


def merged(model_dir: str, adapter: str | None) -> torch.nn.Module:
    """The base model with the adapter merged in (PEFT's merge_and_unload), float32."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def check_against(hf: torch.nn.Module, prompt: list[int], result: dict[str, Any]) -> None:
    """`result` (greedy, with logprobs) is what the model `hf` gives: its argmax after
    every prefix, and each token's logprob within 1e-4, from one teacher-forced forward."""
    out = result["output_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : len(prompt) + len(out) - 1].float()
    assert logits.argmax(-1).tolist() == out
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, str]:
    base = tmp_path_factory.mktemp("lora-models")
    smollm2 = converted_default_model(str(request.config.cache.mkdir("sgl-default-model")))
    # A tiny Llama that speaks SmolLM2's tokenizer: text, chat and grammars at a fraction of the cost.
    chat = tiny_model_dir(base, "llama", vocab=49152, seed=5)
    for f in Path(smollm2).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, Path(chat) / f.name)
    return {"smollm2": smollm2, "qwen3": tiny_model_dir(base, "qwen3", vocab=384, seed=7, head_dim=16), "chat": chat}


@pytest.fixture(scope="module")
def adapters(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """model -> adapter name -> folder, plus "all8-other": another adapter of all8's shape."""
    base = tmp_path_factory.mktemp("lora-adapters")
    out: dict[str, dict[str, str]] = {}
    for m, d in models.items():
        out[m] = {name: make_adapter(d, base / m / name, *spec, seed=i) for i, (name, spec) in enumerate(SPECS.items())}
        out[m]["all8-other"] = make_adapter(d, base / m / "all8-other", *SPECS["all8"], seed=99)
    return out


PROMPTS = [[1, 17, 29, 3, 44, 61, 7], [2, 90, 33, 12], [1, 17, 29, 3, 44, 61, 7, 8, 100, 21, 5]]


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def lora_engine(request: pytest.FixtureRequest, models: dict[str, str],
                adapters: dict[str, dict[str, str]]) -> Iterator[tuple[str, sgl.Engine]]:
    m = request.param
    paths = [f"{n}={p}" for n, p in adapters[m].items() if n in SPECS]
    with sgl.Engine(models[m], lora_paths=paths, skip_tokenizer_init=m != "smollm2", dtype="float32",
                    transport="ipc" if m == "smollm2" else "inproc", random_seed=0) as e:
        yield m, e


def run_mixed(e: sgl.Engine, names: list[str | None]) -> list[tuple[str | None, list[int], dict[str, Any]]]:
    jobs = [(n, p) for n in names for p in PROMPTS]
    res = e.generate(input_ids=[p for _, p in jobs], sampling_params=GREEDY, lora_path=[n for n, _ in jobs],
                     return_logprob=True)
    return [(n, p, r) for (n, p), r in zip(jobs, res)]


def test_mixed_batch_equals_peft_merged(lora_engine: tuple[str, sgl.Engine], models: dict[str, str],
                                        adapters: dict[str, dict[str, str]]) -> None:
    m, e = lora_engine
    got = run_mixed(e, [None, *SPECS])
    refs = {n: merged(models[m], None if n is None else adapters[m][n]) for n in [None, *SPECS]}
    for n, p, r in got:
        check_against(refs[n], p, r)
    # Every adapter changes the outputs: the comparison above could not pass by ignoring them.
    each: dict[str | None, list[int]] = {}
    for n, _, r in got:
        each.setdefault(n, []).extend(r["output_ids"])
    assert len({tuple(v) for v in each.values()}) == len(each), each
    assert e.get_server_info()["lora_adapters"].keys() == set(SPECS)


def test_unload_and_reload(lora_engine: tuple[str, sgl.Engine], models: dict[str, str],
                           adapters: dict[str, dict[str, str]]) -> None:
    m, e = lora_engine
    e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="all8")
    e.unload_lora_adapter("all8")
    with pytest.raises(ValueError, match="lora_path"):
        e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="all8")
    e.load_lora_adapter("all8", adapters[m]["all8-other"])  # the same name, other weights
    try:
        first = e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="all8", return_logprob=True)
        # The prompt cached under the first load is not served to the second.
        assert first["meta_info"]["cached_tokens"] == 0
        check_against(merged(models[m], adapters[m]["all8-other"]), PROMPTS[0], first)
        for n, p, r in run_mixed(e, [None, "qv4"]):
            check_against(merged(models[m], None if n is None else adapters[m][n]), p, r)
    finally:
        e.unload_lora_adapter("all8")
        e.load_lora_adapter("all8", adapters[m]["all8"])


def test_radix_cache_is_keyed_by_adapter(lora_engine: tuple[str, sgl.Engine]) -> None:
    _, e = lora_engine
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    cached = {}
    for n in ["qv4", "qv4", "mlp16", None, "mlp16", None]:
        r = e.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=n)
        cached.setdefault(n, []).append(r["meta_info"]["cached_tokens"])
    assert cached == {"qv4": [0, len(prompt) - 1], "mlp16": [0, len(prompt) - 1], None: [0, len(prompt) - 1]}


def test_refusals_change_nothing(lora_engine: tuple[str, sgl.Engine], models: dict[str, str],
                                 adapters: dict[str, dict[str, str]], tmp_path: Path) -> None:
    m, e = lora_engine
    before = e.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, lora_path="qv4")["output_ids"]
    loaded = e.get_server_info()["lora_adapters"]
    bad_shape = tmp_path / "bad-shape"
    shutil.copytree(adapters[m]["qv4"], bad_shape)
    cfg = json.loads((bad_shape / "adapter_config.json").read_text())
    other = tiny_model_dir(tmp_path, "llama", vocab=300, seed=3, hidden_size=32)  # another hidden size
    wrong_model = make_adapter(other, tmp_path / "wrong-model", 4, ["q_proj"], 8, False, seed=1)
    dora = tmp_path / "dora"
    shutil.copytree(adapters[m]["qv4"], dora)
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    big = make_adapter(models[m], tmp_path / "big", 32, ["q_proj"], 8, False, seed=2)  # rank over the max
    cases = {str(tmp_path / "missing"): "adapter_config.json", wrong_model: "do not fit", str(dora): "DoRA",
             big: "max_lora_rank"}
    for path, why in cases.items():
        with pytest.raises(ValueError, match=why):
            e.load_lora_adapter("new", path)
    with pytest.raises(ValueError, match="loaded already"):
        e.load_lora_adapter("qv4", adapters[m]["mlp16"])
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        e.unload_lora_adapter("never-loaded")
    assert e.get_server_info()["lora_adapters"] == loaded
    assert e.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, lora_path="qv4")["output_ids"] == before


@pytest.fixture(scope="module")
def merged_engines(models: dict[str, str], adapters: dict[str, dict[str, str]],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[sgl.Engine, sgl.Engine]]:
    """A model with adapter all8, and the same with all8 merged into its weights."""
    d = tmp_path_factory.mktemp("merged") / "chat-all8"
    merged(models["chat"], adapters["chat"]["all8"]).save_pretrained(d, safe_serialization=True)
    for f in Path(models["chat"]).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, d / f.name)
    kw: dict[str, Any] = {"dtype": "float32", "transport": "inproc", "random_seed": 0}
    with sgl.Engine(models["chat"], lora_paths=[f"all8={adapters['chat']['all8']}"], **kw) as a, \
            sgl.Engine(str(d), **kw) as b:
        yield a, b


def test_beams_and_grammars_equal_the_merged_model(merged_engines: tuple[sgl.Engine, sgl.Engine]) -> None:
    lora, plain = merged_engines
    beams = {"max_new_tokens": 6, "beam_width": 3, "ignore_eos": True}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    grammar = {"temperature": 0.0, "max_new_tokens": 40, "json_schema": json.dumps(schema)}
    prompt = "Give me a person as JSON:"

    def ids(res: Any) -> Any:  # a beam request gives its beams, best first
        return [r["output_ids"] for r in res] if isinstance(res, list) else res["output_ids"]

    for params in (beams, grammar):
        a = lora.generate(prompt, sampling_params=params, lora_path="all8")
        b = plain.generate(prompt, sampling_params=params)
        assert ids(a) == ids(b)
        base = lora.generate(prompt, sampling_params=params)  # the adapter matters here too
        assert ids(base) != ids(a)
    json.loads(a["text"])


def test_http_routes_name_the_adapter(models: dict[str, str], adapters: dict[str, dict[str, str]]) -> None:
    """A real `sgl serve`: the OpenAI `model` field and SGLang's `lora_path` run the same
    adapter; /v1/models lists adapters under the base; vLLM's load route and SGLang's
    unload route change what the server serves."""
    from tests.serve_util import ServerProc, openai_client

    d = models["chat"]
    s = ServerProc("--model-path", d, "--served-model-name", "smol", "--dtype", "float32",
                   "--lora-paths", f"qv4={adapters['chat']['qv4']}", "--max-lora-rank", "16")
    oai = openai_client(s.url + "/v1", "none", max_retries=0, timeout=120)
    try:
        listed = {m.id: m for m in oai.models.list().data}
        assert set(listed) == {"smol", "qv4"} and getattr(listed["qv4"], "parent", None) == "smol"
        greedy = {"max_tokens": NEW, "temperature": 0, "extra_body": {"ignore_eos": True}}
        via_model = oai.completions.create(model="qv4", prompt=PROMPTS[0], **greedy)  # type: ignore[arg-type]
        assert via_model.model == "qv4"
        native = s.post("/generate", json={"input_ids": PROMPTS[0], "lora_path": "qv4", "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}).json()
        assert via_model.choices[0].text == native["text"]
        base = oai.completions.create(model="smol", prompt=PROMPTS[0], **greedy)  # type: ignore[arg-type]
        assert base.choices[0].text != via_model.choices[0].text
        r = s.post("/v1/load_lora_adapter", json={"lora_name": "all8", "lora_path": adapters["chat"]["all8"]})
        assert r.status_code == 200, r.text
        chat = oai.chat.completions.create(model="all8", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert chat.model == "all8"
        r = s.post("/unload_lora_adapter", json={"lora_name": "all8"})
        assert r.status_code == 200 and r.json()["success"], r.text
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="all8", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)

        async def through_the_client() -> None:  # sgl.Client's calls go the same routes
            async with sgl.Client(s.url) as c:
                assert (await c.load_lora_adapter("mine", adapters["chat"]["qv4"]))["success"]
                out = await c.generate(input_ids=PROMPTS[0], lora_path="mine", sampling_params={
                    "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
                assert isinstance(out, dict) and out["text"] == native["text"]  # qv4's weights, another name
                with pytest.raises(ValueError, match="mine"):
                    await c.load_lora_adapter("mine", adapters["chat"]["all8"])  # the name is taken
                assert (await c.unload_lora_adapter("mine"))["success"]
                with pytest.raises(ValueError):
                    await c.generate(input_ids=PROMPTS[0], lora_path="mine", sampling_params={"max_new_tokens": 1})

        anyio.run(through_the_client)
        s.assert_balanced()
    finally:
        oai.close()
        s.stop()


def test_cli_generate_with_an_adapter(models: dict[str, str], adapters: dict[str, dict[str, str]],
                                      merged_engines: tuple[sgl.Engine, sgl.Engine]) -> None:
    """`sgl generate --lora-path` answers as the model with the adapter merged does."""
    import subprocess
    import sys

    prompt, params = "Give me a person as JSON:", {"temperature": 0.0, "max_new_tokens": 12}
    run = subprocess.run([sys.executable, "-m", "sgl.cli", "generate", prompt, "--raw", "--model-path",
                          models["chat"], "--lora-path", adapters["chat"]["all8"], "--dtype", "float32",
                          "--max-new-tokens", "12", "--transport", "inproc"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    want = merged_engines[1].generate(prompt, params)["text"]
    assert run.stdout.rstrip("\n") == want
    assert want != merged_engines[0].generate(prompt, params)["text"]  # the adapter matters here


def test_a_load_another_rank_failed_is_kept_by_no_rank(models: dict[str, str],
                                                        adapters: dict[str, dict[str, str]]) -> None:
    """Under tensor parallelism an adapter that one rank failed to read (its disk, its memory)
    is kept by none, and takes no id: requests carry the id and take its slots alike on
    every rank, so a rank holding what another lacks would part from it."""
    from sgl.sched.lora import LoraManager
    from sgl.sched.models.parallel import TPGroup
    from sgl.sched.runner.model_runner import ModelRunner

    args = sgl.ServerArgs(max_total_tokens=64, enable_lora=True, max_lora_rank=16, dtype="float32")
    r = ModelRunner(args, models["qwen3"])
    try:
        lora = LoraManager(r, args)
        r.tp = other_rank_failed()
        with pytest.raises(RuntimeError, match="another tensor-parallel rank"):
            lora.load("qv4", adapters["qwen3"]["qv4"])
        assert lora.adapters == {} and lora.ids == {}
        r.tp = TPGroup()
        lora.load("qv4", adapters["qwen3"]["qv4"])
        assert lora.ids == {"qv4": 1}  # the first id: the failed load took none
    finally:
        r.close()
