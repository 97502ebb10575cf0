"""`bench train`'s report of a BenchRun (app/bench/driver.py): one row per policy over its counted steps.

The keys are `python -m app bench train`'s public --json fields (app/commands/bench_train.py lists them);
`bench peer` (app/bench/peer/our_side.py) reuses the same summary.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from app.bench.drift import machine_drift, net_abs_error

BASELINES = ("balanced_packed", "static_cp_packed", "static_cp", "sorted", "dynamic_cp", "chunkflow")
"""The policies every other one is compared with (`speedup_vs_<name>`)."""


def summarize(result: Any) -> dict[str, Any]:
    """The report of a BenchRun (app/bench/driver.py): one row per policy over its counted steps."""
    counted = [r for r in result.records if not r["warmup"]]
    rows = {p: _policy_row([r for r in counted if r["policy"] == p]) for p in result.policies}
    drift = machine_drift(rows)
    for row in rows.values():
        for baseline in BASELINES:
            base = rows.get(baseline)
            row[f"speedup_vs_{baseline}"] = base["step_s_median"] / row["step_s_median"] if base else None
            row[f"paired_speedup_vs_{baseline}"] = _paired_speedup(base, row) if base else None
        row["prediction_abs_error_median_net_of_drift"] = net_abs_error(row, drift)
    config = result.config
    return {
        "policies": rows,
        "steps": result.steps, "warmup_steps": result.warmup_steps,
        "calibration": config.scheduling.calibration,
        "dp_size": config.parallel.dp_size, "cp_size": config.parallel.cp_size,
        "bucket_size": config.scheduling.bucket_size,
        "global_batch_size": config.scheduling.global_batch_size,
        "same_samples": _same_across(rows, "sample_ids"),
        "loss_max_rel_diff": _loss_max_rel_diff(rows),
        "machine_drift": drift,
        "wall_s": result.wall_s, "machine": result.machine, "run_dir": result.run_dir,
        "stale_profile_warning": _stale_profile(counted, config, result.run_dir),
        "distinct_global_batches": result.distinct_global_batches,
        "repeated_samples_warning": repeated_samples_warning(result.steps + result.warmup_steps,
                                                             result.distinct_global_batches, config),
    }


def repeated_samples_warning(total_steps: int, distinct: int, config: Any) -> str | None:
    """A warning when the bench's steps outnumber the data's distinct global batches, else None.

    Past them the planner starts another epoch, so later steps train samples an earlier step trained: with
    online calibration the counted steps' prediction error is then partly measured on the batches the
    profile was fitted to, and a policy's later plans may repeat its earlier ones."""
    if total_steps <= distinct:
        return None
    synthetic = config.data.source == "synthetic" and not getattr(config.data, "sources", ())
    knob = "data.num_samples" if synthetic else "data.path / data.sources (more rows)"
    need = total_steps * config.scheduling.global_batch_size
    return (f"warning: bench train: {total_steps} steps (warm-up included) of "
            f"{config.scheduling.global_batch_size} samples need {need} usable rows, but the data holds "
            f"{distinct} global batches of distinct samples: from step {distinct + 1} on, the steps revisit "
            f"samples earlier steps trained; raise {knob} or lower --steps for distinct batches")


def _stale_profile(counted: list[dict[str, Any]], config: Any, run_dir: str) -> str | None:
    """app/profiling/stale_check.py over the first STALE_STEPS counted steps of every policy, pooled: every
    policy's plans are predicted by the same profile; None when the profile is fresh."""
    from app.profiling.stale_check import STALE_STEPS, STALE_TOLERANCE, median_ratio, stale_warning
    from app.rundir.files import CONFIG_SNAPSHOT

    by_policy: dict[str, list[dict[str, Any]]] = {}
    for record in counted:
        by_policy.setdefault(record["policy"], []).append(record)
    pairs = [(r["predicted_step_s"], r["step_s"]) for records in by_policy.values()
             for r in records[:STALE_STEPS]]
    ratio = median_ratio(pairs)
    if ratio is None or abs(ratio - 1) <= STALE_TOLERANCE:
        return None
    return stale_warning(ratio, config.hardware.profile, str(Path(run_dir) / CONFIG_SNAPSHOT))


def _paired_speedup(base: dict[str, Any], row: dict[str, Any]) -> float:
    """Median over steps of the baseline's step time / this policy's on the same global batch.

    The two ran back to back on the same batch, so a burst of load on the machine hits both: more robust
    than the ratio of medians when the machine is shared.
    """
    pairs = zip(base["per_step"]["step_s"], row["per_step"]["step_s"], strict=True)
    return statistics.median(b / max(t, 1e-12) for b, t in pairs)


def _median(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(finite) if finite else None


def _abs_error(records: list[dict[str, Any]], key: str) -> float | None:
    """Median over the steps of |predicted - measured| / measured (`key`: which prediction; records from
    before the starting profile's prediction was kept fall back to the one they have)."""
    return _median([abs(r.get(key, r["predicted_step_s"]) - r["step_s"]) / r["step_s"] for r in records])


def _imbalance(values: list[float]) -> float:
    """max / mean: 1.0 is perfect balance."""
    return max(values) / max(statistics.fmean(values), 1e-12)


def _per_rank_median(records: list[dict[str, Any]], key: str) -> list[float | None]:
    return [_median([r[key][rank] for r in records]) for rank in range(len(records[0][key]))]


def _policy_row(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of one policy's counted steps (see the module docstring for each key)."""
    step_s = statistics.median(r["step_s"] for r in records)
    predicted = _median([r["predicted_step_s"] for r in records])
    initial = _median([r.get("predicted_step_s_initial", r["predicted_step_s"]) for r in records])
    busy = _per_rank_median(records, "rank_compute_s")
    return {
        "step_s_median": step_s,
        "tokens_per_s": statistics.median(r["tokens"] for r in records) / step_s,
        "predicted_step_s": predicted,
        "prediction_error": predicted / step_s - 1 if predicted is not None else None,
        "prediction_error_before_calibration": initial / step_s - 1 if initial is not None else None,
        "prediction_abs_error_median": _abs_error(records, "predicted_step_s"),
        "prediction_abs_error_median_before_calibration": _abs_error(records, "predicted_step_s_initial"),
        "calibration_version": max(r.get("calibration_version", 0) for r in records),
        "planner_wait_s_median": statistics.median(r["planner_wait_s"] for r in records),
        "step_cpu_s_median": statistics.median(max(r["rank_cpu_s"]) for r in records),
        "compute_imbalance": statistics.median(r["compute_imbalance"] for r in records),
        "cpu_imbalance": statistics.median(_imbalance(r["rank_cpu_s"]) for r in records),
        "busy_s_per_rank": busy,
        "busy_imbalance": _imbalance(busy),
        "cpu_s_per_rank": _per_rank_median(records, "rank_cpu_s"),
        "predicted_busy_s_per_rank": _per_rank_median(records, "rank_predicted_busy_s"),
        "micro_batches_median": statistics.median(r["micro_batches"] for r in records),
        "steps": len(records),
        "torch_threads": records[0]["torch_threads"],
        "per_step": {key: [r[source] for r in records] for key, source in (
            ("step", "step"), ("step_s", "step_s"), ("predicted_step_s", "predicted_step_s"),
            ("loss", "loss"), ("tokens", "tokens"), ("planner_wait_s", "planner_wait_s"),
            ("micro_batches", "micro_batches"), ("sample_ids", "sample_ids"))}
        # records written before per-sequence CP degrees existed have no such key: none were used
        | {"subgroup_token_fraction": [r.get("subgroup_token_fraction", 0.0) for r in records]},
    }


def _same_across(rows: dict[str, dict[str, Any]], key: str) -> bool:
    values = [row["per_step"][key] for row in rows.values()]
    return all(v == values[0] for v in values)


def _loss_max_rel_diff(rows: dict[str, dict[str, Any]]) -> float:
    """Largest |loss - first policy's loss| / |first policy's loss| over every step and policy."""
    losses = [row["per_step"]["loss"] for row in rows.values()]
    pairs = [(a, b) for other in losses for a, b in zip(other, losses[0], strict=True)]
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=0.0)
