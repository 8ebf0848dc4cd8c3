"""Tensor parallelism end to end on CPU (gloo): real scheduler processes, one per rank.

The engine at tp_size > 1 gives Hugging Face's greedy tokens, with the chosen tokens'
logprobs within 1e-4 (float32), on a tiny Qwen2 whose single KV head every rank holds
(replication) and whose q/k/v carry biases, and on a tiny Llama of SmolLM2's head shape
split over 3 ranks (9 query and 3 KV heads split no other way; 3 layers, tied
embeddings, an odd vocabulary), where 2 ranks are refused. Killing one rank fails the requests in flight
and any later one within 5 s, and the KV accounting balances after the TP runs. Weight
updates (from disk, from shared tensors) reach every rank's shard, and so do LoRA adapters.
The model's shards alone are checked tensor by tensor in tests/test_tp_model.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import sgl
from sgl.runtime.tokenizer_manager import EngineDeadError
from tests.conftest import assert_kv_balanced, tiny_model_dir

PROMPTS = [[5, 17, 42, 9, 300], [7, 7, 7], [100, 3, 250, 11, 60, 2, 480]]
NEW = 8


def hf_greedy(model_dir: str, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """Hugging Face's greedy continuation of each prompt and its tokens' logprobs."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        ids = g.sequences[0, len(p):].tolist()
        # Raw logits: HF's scores have min_new_tokens' EOS ban in them, our logprobs do not.
        lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(g.logits, ids)]
        out.append((ids, lps))
    return out


def engine_greedy(model_dir: str, tp: int, prompts: list[list[int]], new: int,
                  **kw: Any) -> tuple[list[tuple[list[int], list[float]]], dict[str, Any]]:
    with sgl.Engine(model_dir, tp_size=tp, transport="ipc", skip_tokenizer_init=True, device="cpu",
                    dtype="float32", **kw) as e:
        outs = e.generate(input_ids=prompts, return_logprob=True,
                          sampling_params={"max_new_tokens": new, "min_new_tokens": new, "temperature": 0})
        info = e.get_server_info()
    got = [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]
    return got, info


def assert_same(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]) -> None:
    for (ids, lps), (hf_ids, hf_lps) in zip(got, want, strict=True):
        assert ids == hf_ids
        assert lps == pytest.approx(hf_lps, abs=1e-4)


def test_tp2_equals_hf_with_replicated_kv_head(tmp_path: Path) -> None:
    d = tiny_model_dir(tmp_path, "qwen2", vocab=512, num_key_value_heads=1)
    got, info = engine_greedy(d, 2, PROMPTS, NEW)
    assert_same(got, hf_greedy(d, PROMPTS, NEW))
    assert_kv_balanced(info)


def test_tp2_sampled_rows_are_rank_zeros_draws(tmp_path: Path) -> None:
    """Sampled rows (filtered, seeded or not) with rank 0's draw broadcast to the other ranks:
    the ranks stay in step to the end, and a seed gives at tp_size 2 what it gives at 1."""
    d = tiny_model_dir(tmp_path, "qwen2", vocab=512, num_key_value_heads=1)
    params = [{"max_new_tokens": NEW, "temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 7, "ignore_eos": True},
              {"max_new_tokens": NEW, "temperature": 1.0, "min_p": 0.05, "seed": 11, "ignore_eos": True},
              {"max_new_tokens": NEW, "temperature": 1.0, "ignore_eos": True}]
    outs = {}
    for tp in (1, 2):
        with sgl.Engine(d, tp_size=tp, transport="ipc", skip_tokenizer_init=True, device="cpu", dtype="float32",
                        random_seed=0) as e:
            outs[tp] = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=params)]
            assert_kv_balanced(e.get_server_info())
    assert all(len(o) == NEW for o in outs[2])
    assert outs[2][:2] == outs[1][:2]


@pytest.fixture(scope="module")
def nine_heads_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("tp3"), "llama", vocab=515, num_attention_heads=9,
                          num_key_value_heads=3, hidden_size=9 * 16, intermediate_size=3 * 64, num_hidden_layers=3,
                          tie_word_embeddings=True)


def test_tp3_nine_heads_equals_hf(nine_heads_dir: str) -> None:
    got, info = engine_greedy(nine_heads_dir, 3, PROMPTS, NEW)
    assert_same(got, hf_greedy(nine_heads_dir, PROMPTS, NEW))
    assert_kv_balanced(info)


def test_tp_size_that_does_not_split_the_heads_is_refused(nine_heads_dir: str) -> None:
    with pytest.raises(ValueError, match="tp_size"):
        sgl.Engine(nine_heads_dir, tp_size=2, transport="ipc", skip_tokenizer_init=True, device="cpu")


def test_tp_with_inproc_is_refused() -> None:
    with pytest.raises(ValueError, match="tp_size=2 needs one process per rank"):
        sgl.Engine("unused", tp_size=2, transport="inproc")


def _pid_of(engine: sgl.AsyncEngine, name: str) -> int:
    return engine.roles.pids()[name]


def test_killing_a_rank_fails_pending_requests_within_5s(tmp_path: Path) -> None:
    d = tiny_model_dir(tmp_path, "llama", vocab=512, num_hidden_layers=4, max_position_embeddings=4096)

    async def main() -> None:
        async with sgl.AsyncEngine(d, tp_size=2, transport="ipc", skip_tokenizer_init=True, device="cpu",
                                   dtype="float32") as e:
            stream = e.stream(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3000, "ignore_eos": True})
            first = await stream.__anext__()
            assert first.get("meta_info", {}).get("finish_reason") is None  # still running
            os.kill(_pid_of(e, "scheduler-tp1"), signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
            assert time.monotonic() - t0 < 5.0

    asyncio.run(main())


def test_tp2_weight_updates_reach_every_rank_shard(tmp_path: Path) -> None:
    """Each rank takes its part of every pushed tensor: after an update from disk and one
    from shared tensors the engine at tp_size=2 gives Hugging Face's tokens on the new
    weights, and a parameter read back is the whole tensor."""
    from safetensors.torch import load_file, save_file

    from sgl.weights import share_tensors

    a = tiny_model_dir(tmp_path, "qwen2", vocab=512, seed=1, num_key_value_heads=1)
    b = tiny_model_dir(tmp_path, "qwen2", vocab=512, seed=2, num_key_value_heads=1)
    weights = load_file(f"{b}/model.safetensors")
    g = torch.Generator().manual_seed(3)
    noisy = {n: weights[n] + 0.3 * torch.randn(weights[n].shape, generator=g)
             for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                       "model.embed_tokens.weight")}
    c = tmp_path / "c"  # b with the noisy tensors, for Hugging Face
    c.mkdir()
    for f in Path(b).iterdir():
        if f.name != "model.safetensors":
            (c / f.name).write_bytes(f.read_bytes())
    save_file({**weights, **noisy}, str(c / "model.safetensors"))
    greedy = {"max_new_tokens": NEW, "min_new_tokens": NEW, "temperature": 0}
    with sgl.Engine(a, tp_size=2, transport="ipc", skip_tokenizer_init=True, device="cpu", dtype="float32") as e:
        e.update_weights_from_disk(b)
        assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=greedy)] == \
            [ids for ids, _ in hf_greedy(b, PROMPTS, NEW)]
        with share_tensors(noisy) as buf:
            e.update_weights_from_tensor(buf.spec)
        assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=greedy)] == \
            [ids for ids, _ in hf_greedy(str(c), PROMPTS, NEW)]
        name = "model.layers.1.mlp.down_proj.weight"
        assert e.get_weights_by_name(name, truncate_size=4096) == \
            pytest.approx(noisy[name].flatten()[:4096].tolist(), abs=1e-6)
        assert_kv_balanced(e.get_server_info())


def test_tp2_lora_adapters_equal_peft_merged(tmp_path: Path) -> None:
    """Each rank keeps its shard of every adapter (B by output rows under q/k/v and gate/up,
    A by input columns under o and down): a batch mixing two adapters and the base model
    gives the PEFT-merged models' tokens and logprobs."""
    from tests.test_lora import ALL, check_against, make_adapter, merged

    d = tiny_model_dir(tmp_path, "llama", vocab=512, seed=4)
    adapters = {"all": make_adapter(d, tmp_path / "all", 4, ALL, 8, False, seed=1),
                "qv": make_adapter(d, tmp_path / "qv", 8, ["q_proj", "v_proj"], 16, True, seed=2)}
    names: list[str | None] = [None, "all", "qv"]
    jobs = [(n, p) for n in names for p in PROMPTS]
    with sgl.Engine(d, tp_size=2, transport="ipc", skip_tokenizer_init=True, device="cpu", dtype="float32",
                    lora_paths=[f"{n}={p}" for n, p in adapters.items()]) as e:
        outs = e.generate(input_ids=[p for _, p in jobs], lora_path=[n for n, _ in jobs], return_logprob=True,
                          sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
        assert_kv_balanced(e.get_server_info())
    refs = {n: merged(d, None if n is None else adapters[n]) for n in names}
    for (n, p), r in zip(jobs, outs):
        check_against(refs[n], p, r)
