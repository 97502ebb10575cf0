"""End to end on an embedded Ray (CPU, gloo): Ray Data -> planner actor -> Ray Train + DeepSpeed workers.

The runs are tiny (8 sequences of ~30 tokens a step, random-init tiny Qwen2 with the real Qwen vocabulary)
so that each Ray Train run takes well under a minute on 2 cores.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from app.config import ConfigError, load_config  # noqa: E402
from app.driver import train  # noqa: E402

NUM_SAMPLES = 24
BATCH = 8
METRICS = {"loss", "tokens_per_s", "step_s", "planner_wait_s", "plan_ms", "compute_imbalance", "grad_norm",
           "planner_ahead_steps"}


def _config(tmp_path: Path, name: str, *overrides: str):
    return load_config("configs/tiny-cpu.yaml", [
        f"run.storage_path={tmp_path}", f"run.name={name}", f"data.num_samples={NUM_SAMPLES}",
        "data.length_scale=0.1", f"scheduling.global_batch_size={BATCH}", "train.steps=6", *overrides,
    ])


def _samples_by_epoch(run_dir: str) -> dict[int, list[int]]:
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for line in Path(run_dir, "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert set(record) == {"step", "epoch", "dp_rank", "sample_ids"}
        by_epoch[record["epoch"]].extend(record["sample_ids"])
    return by_epoch


def test_dp1_cp2_trains_and_static_cp_gives_the_same_losses(tiny_run, local_ray, tmp_path: Path) -> None:
    skrull, _ = tiny_run  # this config with scheduling.policy=skrull, 6 steps (tests/conftest.py)
    assert skrull.steps == 6 and skrull.samples == 6 * BATCH
    assert skrull.loss_last < skrull.loss_first - 0.5, skrull.losses
    # 6 steps x 8 samples = two epochs of 24: every sample id exactly once in each epoch.
    by_epoch = _samples_by_epoch(skrull.run_dir)
    assert sorted(by_epoch) == [0, 1]
    for ids in by_epoch.values():
        assert sorted(ids) == list(range(NUM_SAMPLES))
    assert skrull.checkpoint and Path(skrull.checkpoint).is_dir()
    for metrics in skrull.history:  # what a user's dashboard reads from ray.train.report
        assert set(metrics) >= METRICS, METRICS - set(metrics)
        assert metrics["compute_imbalance"] >= 1 and metrics["planner_ahead_steps"] >= 0
    _check_tensorboard(Path(skrull.run_dir), skrull.history)

    static = train(_config(tmp_path, "static", "scheduling.policy=static_cp"), progress=False)
    # Scheduling changes which rank computes what, never the math of a global batch: fp32 losses agree up
    # to summation order (~1e-7 relative per step), which Adam's normalized updates keep far below 1e-4.
    assert static.losses == pytest.approx(skrull.losses, rel=1e-4)


def _check_tensorboard(run_dir: Path, history: list[dict]) -> None:
    """`tensorboard --logdir` finds every step's curves: read back with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert tags >= {"loss", "tokens_per_s", "tokens_per_s_per_worker", "step_s", "compute_imbalance", "mfu",
                    "padding_fraction"}, tags
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == [m["step"] for m in history]
    assert [e.value for e in losses] == pytest.approx([m["loss"] for m in history], rel=1e-6)
    per_worker = events.Scalars("tokens_per_s_per_worker")[0].value
    assert per_worker == pytest.approx(history[0]["tokens_per_s"] / 2, rel=1e-6)  # DP 1 x CP 2


@pytest.mark.parametrize("overrides, message", [
    (["data.source=path", "data.path=/nonexistent/data.parquet"], "data.path"),
    (["model.name_or_path=/nonexistent/model"], "model.name_or_path"),
    (["data.too_long=error", "data.length_scale=4", "data.max_length=0", "scheduling.bucket_size=64"],
     "data.too_long"),
])
def test_bad_input_fails_before_any_worker_starts(local_ray, tmp_path: Path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        train(_config(tmp_path, "bad", *overrides), progress=False)
    assert not (tmp_path / "bad").exists()


# Resuming (same and another worker count, failures, Ctrl-C): tests/test_resilience.py.
@pytest.mark.parametrize("overrides, message", [
    (["scheduling.bucket_sise=10"], "unknown key 'bucket_sise'"),
    (["parallel.num_workers=3", "parallel.cp_size=2"], "not divisible by parallel.cp_size"),
])
def test_bad_config_is_rejected_on_load(tmp_path: Path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, "bad", *overrides)
