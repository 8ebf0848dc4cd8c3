"""Weight updates and memory release on a running model (sgl.sched.runner.weights,
ModelRunner.release_memory / resume_memory), at the runner's level, on the CPU in
float32: a scheduler's real runner generates greedily, and Hugging Face transformers
with the same weights must give the same tokens.

- from_disk: a second checkpoint of the same architecture (safetensors as started,
  by `load_format`, and a GGUF file), started from dummy weights too; a checkpoint of
  another architecture, a partial one and a bad path are refused with the old weights
  kept bit for bit.
- from_tensors: a trainer in another process shares one layer's noise-added tensors
  (sgl.weights.share_tensors); bad entries are refused first, the buffer stays the
  sender's (opened twice, unlinked by it alone).
- init_group + from_distributed: the trainer broadcasts another layer over gloo.
- get: a parameter's first values, fused ones (q/k/v, gate/up) sliced out.
- release/resume: tags' errors, state, and the same outputs after resume.
Every update copies into the parameters' own storage."""

from __future__ import annotations

import collections
import multiprocessing as mp
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf import _write_gguf
from transformers import AutoConfig, AutoModelForCausalLM
from weights_trainer import noisy_layer, trainer_main

from sgl.core.protocol import (
    BatchTokenIDOutput,
    GenerateReqInput,
    InitWeightsUpdateGroupReq,
    SharedTensors,
    TensorEntry,
    UpdateWeightsFromDistributedReq,
)
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.sched.scheduler import Scheduler
from sgl.weights import share_tensors
from tests.conftest import tiny_model_dir
from tests.fake_channels import ListSender, QueueReceiver

VOCAB = 256
PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [11, 2], [64, 65, 66, 67, 1, 0, 120, 33, 12, 9, 100, 4, 50]]
NEW = 8


# ---- a runner driven through a real scheduler, and Hugging Face's greedy tokens ----

class Engine:
    def __init__(self, model_dir: str, **kw: Any) -> None:
        self.inbox, self.out = QueueReceiver(), ListSender()
        args = ServerArgs(model_path=model_dir, device="cpu", dtype="float32", skip_tokenizer_init=True,
                          disable_radix_cache=True, max_total_tokens=512, max_running_requests=4, **kw)
        self.s = Scheduler(args, model_dir, self.inbox, self.out)
        self.runner = self.s.runner
        self.n = 0

    def greedy(self) -> list[list[int]]:
        ids: dict[str, list[int]] = collections.defaultdict(list)
        rids = []
        for p in PROMPTS:
            self.n += 1
            rids.append(f"r{self.n}")
            params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
            self.inbox.q.append(GenerateReqInput(rids[-1], p, params))
        for _ in range(200):
            self.s.step()
            for m in self.out.msgs:
                if isinstance(m, BatchTokenIDOutput):
                    for rid, new in zip(m.rids, m.new_ids):
                        ids[rid] += new
            self.out.msgs.clear()
            if not self.inbox.q and self.s.idle:
                return [ids[r] for r in rids]
        raise AssertionError("the scheduler did not finish")

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.data.clone() for n, p in self.runner.model.named_parameters()}

    def pointers(self) -> dict[str, int]:
        return {n: p.data_ptr() for n, p in self.runner.model.named_parameters()}

    def close(self) -> None:
        self.s.close()


def hf_greedy(hf: torch.nn.Module) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = list(p)
            for _ in range(NEW):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def hf_model(model_dir: str, replace: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """transformers' model of the directory, its tensors (some replaced) loaded as they are."""
    config = AutoConfig.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_file(str(Path(model_dir) / "model.safetensors")) | (replace or {})
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and config.tie_word_embeddings == bool(missing)
    return hf


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("weights")
    d = {"a": tiny_model_dir(base / "a", "llama", VOCAB, seed=0),
         "b": tiny_model_dir(base / "b", "llama", VOCAB, seed=1),
         "wide": tiny_model_dir(base / "wide", "llama", VOCAB, seed=2, hidden_size=96),
         "qwen3": tiny_model_dir(base / "qwen3", "qwen3", VOCAB, seed=3, head_dim=16)}
    _write_gguf(hf_model(d["b"]), "llama", base / "b.gguf")
    d["b.gguf"] = str(base / "b.gguf")
    partial = base / "partial"
    partial.mkdir()
    tensors = load_file(str(Path(d["b"]) / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text((Path(d["b"]) / "config.json").read_text())
    d["partial"] = str(partial)
    return d


@pytest.fixture(scope="module")
def expected(dirs: dict[str, str]) -> dict[str, list[list[int]]]:
    out = {k: hf_greedy(hf_model(dirs[k])) for k in ("a", "b")}
    assert out["a"] != out["b"], "the two checkpoints must be told apart"
    return out


@pytest.fixture()
def live(dirs: dict[str, str]) -> Iterator[Engine]:
    e = Engine(dirs["a"])
    yield e
    e.close()


# ---- from disk ----

@pytest.mark.parametrize(("start", "source", "load_format"), [
    ("auto", "b", None), ("auto", "b", "safetensors"), ("dummy", "b", None), ("auto", "b.gguf", None),
    ("auto", "b.gguf", "gguf")])
def test_from_disk_gives_the_new_checkpoints_tokens(dirs: dict[str, str], expected: dict[str, list[list[int]]],
                                                  start: str, source: str, load_format: str | None) -> None:
    e = Engine(dirs["a"], load_format=start)
    try:
        if start == "auto":
            assert e.greedy() == expected["a"]
        ptrs = e.pointers()
        n = e.runner.weights.from_disk(dirs[source], load_format)
        assert n == len(e.runner.weights.targets())
        assert e.greedy() == expected["b"]
        assert e.pointers() == ptrs, "an update must copy into the parameters' storage"
    finally:
        e.close()


@pytest.mark.parametrize(("source", "load_format", "match"), [
    ("wide", None, r"hidden_size 96 \(running: 64\)"),
    ("qwen3", None, r"architectures \['Qwen3ForCausalLM'\].*running: \['LlamaForCausalLM'\]"),
    ("partial", None, r"missing weights in model_path=.*model\.layers\.1\.mlp\.up_proj\.weight"),
    ("b", "dummy", "load_format='dummy' reads no checkpoint"),
    ("b.gguf", "safetensors", "load_format='safetensors' but .* is a GGUF file"),
    ("nowhere", None, "model_path='nowhere' does not exist"),
])
def test_from_disk_refuses_and_keeps_the_old_weights(live: Engine, dirs: dict[str, str],
                                                   expected: dict[str, list[list[int]]], source: str,
                                                   load_format: str | None, match: str) -> None:
    before = live.params()
    with pytest.raises(ValueError, match=match):
        live.runner.weights.from_disk(dirs.get(source, source), load_format)
    after = live.params()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert live.greedy() == expected["a"]


# ---- from another process: shared tensors and a broadcast group ----

@pytest.fixture(scope="module")
def trainer(dirs: dict[str, str]) -> Iterator[Any]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=trainer_main, args=(dirs["a"], there), daemon=True)
    proc.start()
    yield here
    here.send_bytes(msgspec.msgpack.encode({"op": "exit"}))
    assert here.recv_bytes() == b"bye"
    proc.join(timeout=30)
    assert proc.exitcode == 0


def ask(trainer: Any, **cmd: Any) -> bytes:
    trainer.send_bytes(msgspec.msgpack.encode(cmd))
    assert trainer.poll(120), f"the trainer did not answer {cmd}"
    return bytes(trainer.recv_bytes())


def test_from_tensors_shared_by_another_process(live: Engine, dirs: dict[str, str], trainer: Any,
                                                expected: dict[str, list[list[int]]]) -> None:
    spec = msgspec.msgpack.decode(ask(trainer, op="share", layer=0, seed=11), type=SharedTensors)
    new = noisy_layer(dirs["a"], 0, 11)
    assert [e.name for e in spec.entries] == list(new) and spec.shm_name and spec.cuda is None
    assert all(e.offset % 256 == 0 for e in spec.entries)
    before, ptrs = live.params(), live.pointers()
    first = spec.entries[0]
    bad = {
        "wrong shape": ([TensorEntry(first.name, first.dtype, [3, 3], first.offset)], "has shape \\(3, 3\\)"),
        "unknown name": ([TensorEntry("model.layers.0.self_attn.q_prj.weight", "float32", [64, 64], 0)],
                         "unexpected weight 'model.layers.0.self_attn.q_prj.weight'.*close names: "
                         "model.layers.0.self_attn.q_proj.weight"),
        "bad dtype": ([TensorEntry(first.name, "int8", first.shape, first.offset)], "dtype 'int8'"),
        "outside": ([TensorEntry(first.name, first.dtype, first.shape, spec.nbytes - 4)],
                    f"tensor entry '{first.name}': bytes .* outside the buffer"),
        "one bad of many": ([*spec.entries[:-1], TensorEntry(spec.entries[-1].name, "float32", [1], 0)],
                            f"weight '{spec.entries[-1].name}' has shape \\(1,\\)"),
    }
    for why, (entries, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            live.runner.weights.from_tensors(msgspec.structs.replace(spec, entries=entries))
        after = live.params()
        assert all(torch.equal(before[k], after[k]) for k in before), why
    with pytest.raises(ValueError, match="no shared memory named 'nope'"):
        live.runner.weights.from_tensors(msgspec.structs.replace(spec, shm_name="nope"))
    assert live.greedy() == expected["a"]

    assert live.runner.weights.from_tensors(spec) == len(new)
    assert live.runner.weights.from_tensors(spec) == len(new)  # still open: the sender owns it
    assert live.pointers() == ptrs
    want = hf_greedy(hf_model(dirs["a"], new))
    assert want != expected["a"] and live.greedy() == want
    assert ask(trainer, op="close") == b"closed"
    with pytest.raises(ValueError, match="no shared memory named"):
        live.runner.weights.from_tensors(spec)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_from_distributed_broadcast_by_a_trainer(live: Engine, dirs: dict[str, str], trainer: Any,
                                                 expected: dict[str, list[list[int]]]) -> None:
    weights = live.runner.weights
    new = noisy_layer(dirs["a"], 1, 22)
    port = _free_port()
    req = InitWeightsUpdateGroupReq(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                                    backend="gloo")
    with pytest.raises(ValueError, match="backend='nccl' needs a CUDA device"):
        weights.init_group(msgspec.structs.replace(req, backend="nccl"))
    with pytest.raises(ValueError, match="rank_offset=0"):
        weights.init_group(msgspec.structs.replace(req, rank_offset=0))
    update = UpdateWeightsFromDistributedReq(names=list(new), dtypes=["float32"] * len(new),
                                             shapes=[list(t.shape) for t in new.values()])
    with pytest.raises(ValueError, match="group_name='weight_update_group': no such weight update group"):
        weights.from_distributed(update)

    ptrs = live.pointers()
    trainer.send_bytes(msgspec.msgpack.encode({"op": "broadcast", "port": port, "layer": 1, "seed": 22}))
    weights.init_group(req)  # joins while the trainer does
    with pytest.raises(ValueError, match="in that group already"):
        weights.init_group(req)
    with pytest.raises(ValueError, match="non-empty lists of equal length"):
        weights.from_distributed(msgspec.structs.replace(update, dtypes=["float32"]))
    with pytest.raises(ValueError, match="has shape"):
        weights.from_distributed(msgspec.structs.replace(update, shapes=[[1]] * len(new)))
    assert weights.from_distributed(update) == len(new)
    assert trainer.poll(60) and trainer.recv_bytes() == b"sent"
    weights.destroy_group("weight_update_group")
    with pytest.raises(ValueError, match="no such weight update group"):
        weights.destroy_group("weight_update_group")
    assert live.pointers() == ptrs
    want = hf_greedy(hf_model(dirs["a"], new))
    assert want != expected["a"] and live.greedy() == want


def test_joining_a_group_nobody_serves_times_out(live: Engine) -> None:
    live.runner.weights.group_timeout_s = 1
    req = InitWeightsUpdateGroupReq(master_address="127.0.0.1", master_port=_free_port(), rank_offset=1,
                                    world_size=2, backend="gloo")
    with pytest.raises(RuntimeError, match=r"weight update group 'weight_update_group' at .*master_port=.*within 1 s"):
        live.runner.weights.init_group(req)
    assert not live.runner.weights.groups


# ---- reading weights back ----

@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight", "model.embed_tokens.weight",
    "model.norm.weight", "lm_head.weight"])
def test_get_returns_the_hf_parameters_first_values(live: Engine, dirs: dict[str, str], name: str) -> None:
    want = hf_model(dirs["a"]).state_dict()[name].flatten()
    got = live.runner.weights.get(name, 100)
    assert got == want[:100].tolist()
    assert live.runner.weights.get(name, 10**9) == want.tolist()


def test_get_unknown_name(live: Engine) -> None:
    with pytest.raises(ValueError, match="no such weight; close names: model.layers.0.self_attn.q_proj.weight"):
        live.runner.weights.get("model.layers.0.self_attn.q_prj.weight", 5)


# ---- memory release ----

def test_release_and_resume_memory(live: Engine, dirs: dict[str, str], expected: dict[str, list[list[int]]]
                                   ) -> None:
    r = live.runner
    assert live.greedy() == expected["a"] and r.released == frozenset()
    before = live.params()
    with pytest.raises(ValueError, match="unknown memory tag 'gpu'"):
        r.release_memory({"weights", "gpu"})
    assert r.released == frozenset()
    with pytest.raises(ValueError, match="memory tag 'kv_cache' is not released"):
        r.resume_memory({"kv_cache"})

    r.release_memory({"weights", "kv_cache"})
    assert r.released == {"weights", "kv_cache"}
    assert r.kv_pool.nbytes() == 0 and all(p.numel() == 0 for p in r.model.parameters())
    with pytest.raises(ValueError, match="memory tag 'weights' is released already"):
        r.release_memory({"weights"})
    with pytest.raises(ValueError, match="the weights are released"):
        r.weights.get("model.norm.weight", 4)
    with pytest.raises(ValueError, match="the weights are released"):
        r.weights.from_disk(dirs["b"], None)

    r.resume_memory({"weights"})
    assert r.released == {"kv_cache"}
    with pytest.raises(ValueError, match="memory tag 'weights' is not released"):
        r.resume_memory({"weights", "kv_cache"})
    assert r.released == {"kv_cache"}  # the refused call changed nothing
    r.resume_memory({"kv_cache"})
    assert r.released == frozenset() and r.kv_pool.nbytes() > 0
    after = live.params()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert live.greedy() == expected["a"]
    assert {"release_s", "resume_s"} <= set(r.info()["memory"])

    r.release_memory({"kv_cache"})  # one tag alone, then the update a trainer would do meanwhile
    r.weights.from_disk(dirs["b"], None)
    r.resume_memory({"kv_cache"})
    assert live.greedy() == expected["b"]


def test_share_tensors_round_trip_and_refusals() -> None:
    from sgl.weights import open_shared

    a, b = torch.arange(6.0).view(2, 3), torch.ones(5, dtype=torch.bfloat16)
    with share_tensors({"a": a.t(), "b": b}) as buf:  # a non-contiguous one is packed contiguous
        assert [(e.name, e.dtype, e.shape, e.offset) for e in buf.spec.entries] == [
            ("a", "float32", [3, 2], 0), ("b", "bfloat16", [5], 256)]
        with open_shared(buf.spec, torch.device("cpu")) as views:
            assert torch.equal(views[0][1], a.t()) and torch.equal(views[1][1], b)
    with pytest.raises(ValueError, match="tensor 'i' is int64"):
        share_tensors([("i", torch.arange(3))])
    with pytest.raises(ValueError, match="tensor 'a' is given twice"):
        share_tensors([("a", a), ("a", a)])
    with pytest.raises(ValueError, match="at least one tensor"):
        share_tensors({})
