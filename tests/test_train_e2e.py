"""End to end on an embedded Ray (CPU, gloo): Ray Data -> planner actor -> Ray Train + DeepSpeed workers.

The runs are tiny (8 sequences of ~30 tokens a step, random-init tiny Qwen2 with the real Qwen vocabulary)
so that each Ray Train run takes well under a minute on 2 cores. They hold 40% of the rows out for the
validation loss (EVAL): tests/test_eval_loss.py checks that on the same shared run.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from app.config import ConfigError, load_config  # noqa: E402
from app.train.driver import train  # noqa: E402
from scheduling.holdout import held_out  # noqa: E402
from tests.run_configs import scheduled_lrs  # noqa: E402

NUM_SAMPLES = 24
BATCH = 8
EVAL_FRACTION = 0.4
EVAL = (f"data.eval_fraction={EVAL_FRACTION}", "train.eval_every=2", "train.log_every=3")
"""The shared run's eval set: evaluated on steps 2, 4 and 6, metrics reduced on steps 3 and 6."""
TRAIN_IDS = sorted(set(range(NUM_SAMPLES)) - set(np.flatnonzero(held_out(np.arange(NUM_SAMPLES), seed=0,
                                                                          fraction=EVAL_FRACTION)).tolist()))
"""The 17 sample ids that train (every row of this data is usable, so ids are stream positions)."""
METRICS = {"loss", "tokens_per_s", "step_s", "planner_wait_s", "plan_ms", "compute_imbalance", "grad_norm",
           "planner_ahead_steps"}


def _config(tmp_path: Path, name: str, *overrides: str):
    return load_config("configs/tiny-cpu.yaml", [
        f"run.storage_path={tmp_path}", f"run.name={name}", f"data.num_samples={NUM_SAMPLES}",
        "data.length_scale=0.1", f"scheduling.global_batch_size={BATCH}", "train.steps=6", *overrides,
    ])


def _sample_ids_by_step(run_dir: str) -> list[list[int]]:
    records = [json.loads(line) for line in Path(run_dir, "samples.jsonl").read_text().splitlines()]
    assert all(set(record) == {"step", "epoch", "dp_rank", "sample_ids"} for record in records)
    assert [record["step"] for record in records] == list(range(1, len(records) + 1))  # DP 1: one line a step
    return [record["sample_ids"] for record in records]


def test_dp1_cp2_trains_every_sample_and_reports_its_metrics(tiny_run) -> None:
    """The shared run. That another policy (static_cp, every sequence sharded) gives the same losses on the
    same global batches is tests/test_bench_train.py's: one engine per policy from the same weights."""
    skrull, _ = tiny_run  # this config with scheduling.policy=skrull, 6 steps (tests/conftest.py)
    assert skrull.steps == 6 and skrull.samples == 6 * BATCH
    assert skrull.loss_last < skrull.loss_first - 0.5, skrull.losses
    # 6 steps x 8 samples = 48 draws from the 17 training rows: two whole epochs, then 14 rows of the third.
    # A global batch may straddle two epochs (the planner reorders within it), so: every training id is
    # drawn 2 or 3 times (14 of them 3 times), never twice in a step, and steps 1-2 plus one id of step 3
    # are the whole first epoch.
    steps = _sample_ids_by_step(skrull.run_dir)
    counts = Counter(i for ids in steps for i in ids)
    assert len(TRAIN_IDS) == 17 and sorted(counts) == TRAIN_IDS
    assert sorted(Counter(counts.values()).items()) == [(2, 3), (3, 14)]
    assert all(len(set(ids)) == len(ids) == BATCH for ids in steps)
    first_two = set(steps[0] + steps[1])
    rest_of_epoch_0 = set(TRAIN_IDS) - first_two
    assert len(first_two) == 16 and len(rest_of_epoch_0) == 1 and rest_of_epoch_0 <= set(steps[2])
    assert skrull.checkpoint and Path(skrull.checkpoint).is_dir()
    for metrics in skrull.history:  # what a user's dashboard reads from ray.train.report
        assert set(metrics) >= METRICS, METRICS - set(metrics)
        assert metrics["compute_imbalance"] >= 1 and metrics["planner_ahead_steps"] >= 0
    _check_tensorboard(Path(skrull.run_dir), skrull.history)
    assert [m["lr"] for m in skrull.history] == pytest.approx(scheduled_lrs(0.003, 2, 6, 0.1), rel=1e-6)


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
    lrs = events.Scalars("lr")
    assert [e.step for e in lrs] == [m["step"] for m in history]
    assert [e.value for e in lrs] == pytest.approx([m["lr"] for m in history], rel=1e-6)
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
