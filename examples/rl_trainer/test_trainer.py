"""The RL trainer example end to end: a real `sgl serve` on two tiny checkpoints, driven
over HTTP with SGLang's bodies (the CPU, a few seconds of rollouts)."""

from __future__ import annotations

from pathlib import Path

from examples.rl_trainer.trainer import NEW_VERSION, ROLLOUTS, run


def test_rollouts_cross_a_weight_update_and_a_memory_release(tmp_path: Path) -> None:
    report = run(tmp_path)
    assert report.versions == ("default", NEW_VERSION)
    assert report.rollout_versions == [["default", NEW_VERSION]] * ROLLOUTS
    assert report.paused["success"] and report.paused["status"] == "ok"
    assert report.updated["success"] and report.updated["num_paused_requests"] >= 0
    assert report.released["success"] and report.resumed["success"]
