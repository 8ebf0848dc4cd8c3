"""Stateful property test of LoRA adapters on a real engine (a tiny Qwen3, float32, two
device slots for four adapter files under three names): random interleavings of
load, unload and generate (batches mixing adapters and the base model, and requests
racing an unload of their own adapter) keep every output equal to its adapter's
PEFT-merged reference, the loaded set equal to the model's, and the KV accounting
balanced after every step."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import sgl
from tests.conftest import assert_kv_balanced, tiny_model_dir
from tests.test_lora import make_adapter, merged

try:
    from .hypothesis_profiles import PROFILE, PROFILE_NAME
except ImportError:
    from hypothesis_profiles import PROFILE, PROFILE_NAME  # type: ignore[no-redef]

NAMES = ["x", "y", "z"]
FILES = 4
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 40, 41, 42, 43, 44, 7, 9], [9, 8, 7], [300, 2, 2, 2, 2, 5, 6]]
NEW = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
EXAMPLES = {"ci": 12, "long": 150}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[sgl.Engine, list[str], dict]]:
    base = tmp_path_factory.mktemp("lora-machine")
    model = tiny_model_dir(base, "qwen3", vocab=320, seed=11, head_dim=16)
    targets = [["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"], ["k_proj", "o_proj"],
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]]
    files = [make_adapter(model, Path(base) / f"f{i}", [2, 4, 8, 8][i], targets[i], 16, False, seed=50 + i)
             for i in range(FILES)]
    refs: dict[tuple[int | None, int], list[int]] = {}
    for f in [None, *range(FILES)]:
        hf = merged(model, None if f is None else files[f])
        for k, p in enumerate(PROMPTS):
            ids = torch.tensor([p])
            with torch.no_grad():
                for _ in range(NEW):
                    ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            refs[(f, k)] = ids[0, len(p):].tolist()
    with sgl.Engine(model, enable_lora=True, max_lora_rank=8, max_loras_per_batch=2, skip_tokenizer_init=True,
                    dtype="float32", transport="inproc", random_seed=0) as e:
        yield e, files, refs


class LoraMachine(RuleBasedStateMachine):
    world: tuple[sgl.Engine, list[str], dict]

    def __init__(self) -> None:
        super().__init__()
        self.engine, self.files, self.refs = self.world
        self.loaded: dict[str, int] = {}  # name -> file index
        self.pool = ThreadPoolExecutor(1)

    def teardown(self) -> None:
        for name in self.loaded:
            self.engine.unload_lora_adapter(name)
        self.pool.shutdown()

    @rule(name=st.sampled_from(NAMES), f=st.integers(0, FILES - 1))
    def load(self, name: str, f: int) -> None:
        if name in self.loaded:
            with pytest.raises(ValueError, match="loaded already"):
                self.engine.load_lora_adapter(name, self.files[f])
            return
        self.engine.load_lora_adapter(name, self.files[f])
        self.loaded[name] = f

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        if name not in self.loaded:
            with pytest.raises(ValueError, match="no LoRA adapter named"):
                self.engine.unload_lora_adapter(name)
            return
        self.engine.unload_lora_adapter(name)
        del self.loaded[name]

    @rule(picks=st.lists(st.tuples(st.sampled_from([None, *NAMES]), st.integers(0, len(PROMPTS) - 1)),
                         min_size=1, max_size=6))
    def generate(self, picks: list[tuple[str | None, int]]) -> None:
        names = [n if n is None or n in self.loaded else None for n, _ in picks]
        out = self.engine.generate(input_ids=[PROMPTS[k] for _, k in picks], sampling_params=GREEDY,
                                   lora_path=names)
        for n, (_, k), r in zip(names, picks, out):
            assert r["output_ids"] == self.refs[(None if n is None else self.loaded[n], k)], (n, k)

    @rule(name=st.sampled_from(NAMES), k=st.integers(0, len(PROMPTS) - 1))
    def race_unload(self, name: str, k: int) -> None:
        """A request of an adapter and that adapter's unload, sent together: the unload is
        refused while the request lives, or the request finished first, or it arrived after
        the unload and is refused; every output it gives is its adapter's."""
        if name not in self.loaded:
            return
        f = self.loaded[name]
        params = {**GREEDY, "max_new_tokens": NEW}
        job = self.pool.submit(self.engine.generate, input_ids=PROMPTS[k], sampling_params=params, lora_path=name)
        try:
            self.engine.unload_lora_adapter(name)
            unloaded = True
        except ValueError as e:
            assert "live requests use" in str(e)
            unloaded = False
        try:
            assert job.result()["output_ids"] == self.refs[(f, k)]
        except ValueError as e:
            assert unloaded and "lora_path" in str(e), e
        if unloaded:
            del self.loaded[name]

    @invariant()
    def balanced_and_listed(self) -> None:
        info = self.engine.get_server_info()
        assert_kv_balanced(info)
        assert set(info["lora_adapters"]) == set(self.loaded)


def test_lora_machine(world: tuple[sgl.Engine, list[str], dict]) -> None:
    LoraMachine.world = world
    run_state_machine_as_test(LoraMachine, settings=settings(
        PROFILE, max_examples=EXAMPLES.get(PROFILE_NAME, PROFILE.max_examples), stateful_step_count=12,
        deadline=None))
