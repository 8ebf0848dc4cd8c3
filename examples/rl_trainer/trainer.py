"""An RL trainer's loop against `sgl serve`, spoken in SGLang's HTTP API only (plain
httpx calls with SGLang's request bodies), as a trainer written for SGLang would:

1. write two tiny Llama checkpoints (the "policy" before and after a training step)
   and start `sgl serve` on the first, with an API key for rollouts and an admin key
   for the control routes;
2. stream rollouts and, while they run, pause generation (retract), load the second
   checkpoint with /update_weights_from_disk under a new weight version, and continue:
   every rollout finishes, its first tokens made by the old weights and its last by
   the new (meta_info.weight_version says which);
3. check the served weights are the checkpoint's (/get_weights_by_name) and the version
   (/get_weight_version);
4. pause, release the device memory (/release_memory_occupation) as a trainer sharing
   the GPU does, resume it, continue, flush the cache, and check that greedy rollouts
   are the same as before the release.

    python examples/rl_trainer/trainer.py [WORKDIR]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

API_KEY = "sk-rollouts"
ADMIN_KEY = "sk-trainer-admin"
VOCAB = 256
ROLLOUTS = 4
ROLLOUT_TOKENS = 512  # long enough to be mid-generation when the trainer pauses
NEW_VERSION = "step-1"
PROBE = "model.embed_tokens.weight"  # the parameter whose values the trainer checks
START_TIMEOUT_S = 180
CALL_TIMEOUT_S = 120


class TrainerError(AssertionError):
    """The server did not behave as the trainer expects."""


def write_checkpoint(path: Path, seed: int) -> Path:
    """A tiny random Llama (2 layers, 256 ids) saved as safetensors: the policy's weights."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      bos_token_id=0, eos_token_id=VOCAB - 1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def checkpoint_values(path: Path, name: str, n: int) -> list[float]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return [float(v) for v in f.get_tensor(name).flatten()[:n]]


class Server:
    """`sgl serve MODEL` on a free port of 127.0.0.1; `stop` sends SIGTERM."""

    def __init__(self, model: Path) -> None:
        cmd = [sys.executable, "-m", "sgl.launch_server", str(model), "--host", "127.0.0.1", "--port", "0",
               "--skip-tokenizer-init", "--max-total-tokens", "8192", "--random-seed", "0",
               "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.url = self._ready()

    def _ready(self) -> str:
        assert self.proc.stdout is not None
        timer = threading.Timer(START_TIMEOUT_S, self.proc.kill)  # a stuck start ends the readline below
        timer.start()
        try:
            for line in self.proc.stdout:
                if "ready on " in line:
                    return line.rsplit(" ", 1)[1].strip()
        finally:
            timer.cancel()
        raise TrainerError(f"sgl serve did not start (exit {self.proc.wait()})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Api:
    """The trainer's HTTP calls: rollouts with the API key, control with the admin key."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=CALL_TIMEOUT_S)
        self.user = {"Authorization": f"Bearer {API_KEY}"}
        self.admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def control(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        r = self.http.request(method, path, json=body, headers=self.admin)
        if r.status_code != 200:
            raise TrainerError(f"{path} answered {r.status_code}: {r.text}")
        return r.json() if r.content else None

    def generate(self, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        r = self.http.post("/generate", headers=self.user, json={
            "input_ids": input_ids, "sampling_params": greedy(max_new_tokens)})
        if r.status_code != 200:
            raise TrainerError(f"/generate answered {r.status_code}: {r.text}")
        return dict(r.json())

    def stream(self, input_ids: list[int], max_new_tokens: int) -> Iterator[dict[str, Any]]:
        """SGLang's /generate stream: each chunk holds the rollout so far."""
        body = {"input_ids": input_ids, "sampling_params": greedy(max_new_tokens), "stream": True}
        with self.http.stream("POST", "/generate", json=body, headers=self.user) as r:
            if r.status_code != 200:
                raise TrainerError(f"/generate answered {r.status_code}: {r.read().decode()}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise TrainerError(f"a rollout failed: {chunk['error']}")
                yield chunk

    def close(self) -> None:
        self.http.close()


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}


@dataclass
class Rollout:
    """One streamed rollout: the weight versions its chunks were made with, and its end."""

    input_ids: list[int]
    started: threading.Event = field(default_factory=threading.Event)
    versions: list[str] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)

    def run(self, api: Api) -> Rollout:
        try:
            for chunk in api.stream(self.input_ids, ROLLOUT_TOKENS):
                version = chunk["meta_info"]["weight_version"]
                if not self.versions or self.versions[-1] != version:
                    self.versions.append(version)
                self.last = chunk
                self.started.set()
        finally:
            self.started.set()  # a failed rollout must not leave the trainer waiting
        return self


@dataclass
class Report:
    versions: tuple[str, str]  # before and after the update
    rollout_versions: list[list[str]]
    paused: dict[str, Any]
    updated: dict[str, Any]
    released: dict[str, Any]
    resumed: dict[str, Any]


def check(ok: bool, what: str) -> None:
    if not ok:
        raise TrainerError(what)


def train_step(api: Api, new_checkpoint: Path) -> Report:
    """Rollouts across a weight update, then a memory release and resume."""
    before = api.control("/get_weight_version", method="GET")["weight_version"]
    rollouts = [Rollout([1 + i, 2 + i, 3 + i]) for i in range(ROLLOUTS)]
    with ThreadPoolExecutor(ROLLOUTS) as pool:
        running = [pool.submit(r.run, api) for r in rollouts]
        for r in rollouts:
            r.started.wait(CALL_TIMEOUT_S)
        paused = api.control("/pause_generation", {"mode": "retract"})
        updated = api.control("/update_weights_from_disk", {
            "model_path": str(new_checkpoint), "load_format": None, "abort_all_requests": False,
            "weight_version": NEW_VERSION, "flush_cache": True})
        api.control("/continue_generation", {})
        done = [f.result(CALL_TIMEOUT_S) for f in running]
    for r in done:
        meta = r.last["meta_info"]
        check(meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == ROLLOUT_TOKENS,
              f"a rollout did not finish: {meta['finish_reason']}")
        check(r.versions == [before, NEW_VERSION], f"a rollout's weight versions: {r.versions}")
    after = api.control("/get_weight_version", method="GET")["weight_version"]
    check(after == NEW_VERSION, f"/get_weight_version says {after!r}")
    served = api.control("/get_weights_by_name", {"name": PROBE, "truncate_size": 4})
    expected = checkpoint_values(new_checkpoint, PROBE, 4)
    check(all(abs(a - b) < 1e-5 for a, b in zip(served, expected, strict=True)),
          f"served {PROBE} {served} is not the checkpoint's {expected}")

    reference = api.generate([7, 8, 9], 16)
    check(reference["meta_info"]["weight_version"] == NEW_VERSION, "a new rollout used the old weights")
    api.control("/pause_generation", {"mode": "abort"})
    released = api.control("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    resumed = api.control("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    api.control("/continue_generation", {})
    api.control("/flush_cache", {})
    again = api.generate([7, 8, 9], 16)
    check(again["output_ids"] == reference["output_ids"], "the weights changed across a memory release")
    return Report((before, after), [r.versions for r in done], paused, updated, released, resumed)


def run(workdir: Path) -> Report:
    policy, new_policy = write_checkpoint(workdir / "policy-0", 0), write_checkpoint(workdir / "policy-1", 1)
    server = Server(policy)
    api = Api(server.url)
    try:
        return train_step(api, new_policy)
    finally:
        api.close()
        server.stop()


def main() -> None:
    workdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="rl-trainer-"))
    os.makedirs(workdir, exist_ok=True)
    report = run(workdir)
    print(f"weights {report.versions[0]} -> {report.versions[1]}; {len(report.rollout_versions)} rollouts crossed "
          f"the update: {report.rollout_versions}")
    print(f"update: {report.updated}")


if __name__ == "__main__":
    main()
