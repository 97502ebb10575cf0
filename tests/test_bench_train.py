"""`bench train`: every policy trains the same global batches in one worker group, interleaved.

The smoke test runs the real command (`python -m app bench train --json --plot`) on the tiny CPU config with
the benchmark's small vocabulary (so no LM head of 152k words dominates), 8 sequences a step, 1 warm-up + 5
counted steps of seven policies (calibration off: no calibration window before the counted steps), at
DP=1 x CP=4 (four workers): one Ray session (Ray, Ray Data, the worker group and 7 engines per worker
start once; the steps themselves take well under a second).

It is also the 6-step training run of the chunkflow policy beside skrull on the same batches: with
ChunkSize = BucketSize 128 and lengths up to 512, chunkflow cuts every longer sequence into up to 4
dependent chunks on one of its 4 ranks (each CP rank is a ChunkFlow rank), and its losses must equal the
others' as theirs do (tests/test_chunkflow_step.py checks its gradients exactly).

It is also the end-to-end test of per-sequence CP degrees (docs/design.md §13): skrull plans with
`scheduling.cp_degrees: auto`, and with BucketSize 128 and LMSYS-like lengths up to 512 some sequences
go to a 2-rank subgroup, so the workers build the subgroup process groups and run those rings beside the
4-rank one and the local attention. Every policy trains the same samples from the same weights, so the
losses must agree to fp32 summation order (1e-4 relative) with static_cp's, which shards every sequence
over all four ranks. The hardware profile is the committed CPU one with a slower link, written by the
test: with the real one the planner picks a subgroup on only about 1 global batch in 3 of this data, and
the test must see one on the steps it trains. A profile changes which plan is chosen, never what a plan
computes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from app.__main__ import main
from app.commands.bench_train import BASELINES, format_report, plot_bench, summarize
from app.rundir.files import jsonable

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("skrull", "balanced_packed", "static_cp_packed", "static_cp", "sorted", "dynamic_cp", "chunkflow")
COUNTED = 5
"""Counted steps after the warm-up: a 6-step run of every policy."""
PUBLIC_KEYS = {"step_s_median", "tokens_per_s", "predicted_step_s", "prediction_error",
               "speedup_vs_balanced_packed",
               "speedup_vs_static_cp_packed", "speedup_vs_static_cp", "speedup_vs_sorted",
               "speedup_vs_dynamic_cp", "speedup_vs_chunkflow", "planner_wait_s_median"}
TINY = ["--config", str(REPO / "configs/tiny-cpu.yaml"), "--set", "data.num_samples=48",
        "--set", "data.length_scale=0.1", "--set", "scheduling.global_batch_size=8",
        "--set", f"data.tokenizer={REPO / 'configs/bench/synth-bpe-773.json'}"]
CP4_MIXED = ["--set", "data.length_scale=0.25", "--set", "parallel.num_workers=4",
             "--set", "parallel.cp_size=4", "--set", "scheduling.bucket_size=128",
             "--set", "data.max_length=512", "--set", "scheduling.cp_degrees=auto",
             "--set", "resources.cpus_per_worker=0.25"]


def _slow_link_profile(tmp_path: Path) -> Path:
    """configs/hardware/cpu.yaml with a 2 MB/s link: rings cost enough that fewer ranks pay off."""
    profile = yaml.safe_load((REPO / "configs/hardware/cpu.yaml").read_text())
    profile["intra_node_bandwidth"] = 2.0e6
    path = tmp_path / "slow-link.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def test_bench_train_json_smoke(local_ray, tmp_path: Path, capsys) -> None:
    plot = tmp_path / "bench.png"
    argv = ["bench", "train", *TINY, *CP4_MIXED, "--set", f"hardware.profile={_slow_link_profile(tmp_path)}",
            "--set", f"run.storage_path={tmp_path / 'runs'}",
            "--policies", ",".join(POLICIES), "--steps", str(COUNTED), "--calibration", "off", "--json",
            "--plot", str(plot)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = result["policies"]
    assert list(rows) == list(POLICIES)
    for policy, row in rows.items():
        assert set(row) >= PUBLIC_KEYS, (policy, PUBLIC_KEYS - set(row))
        assert row["steps"] == COUNTED and row["step_s_median"] > 0 and row["tokens_per_s"] > 0
        assert row["predicted_step_s"] > 0
        assert row["prediction_error"] == pytest.approx(row["predicted_step_s"] / row["step_s_median"] - 1)
        for baseline in BASELINES:
            expected = rows[baseline]["step_s_median"] / row["step_s_median"]
            assert row[f"speedup_vs_{baseline}"] == pytest.approx(expected)
    # Step n of every policy is the same global batch (the warm-up step 1 is left out) ...
    per_step = [row["per_step"] for row in rows.values()]
    assert all(steps["step"] == list(range(2, COUNTED + 2)) for steps in per_step)
    assert all(steps["sample_ids"] == per_step[0]["sample_ids"] for steps in per_step)
    assert per_step[0]["sample_ids"] == [list(range(8 * s, 8 * s + 8)) for s in range(1, COUNTED + 1)]
    assert result["same_samples"] is True
    assert result["distinct_global_batches"] == 6 and result["repeated_samples_warning"] is None  # 48 / 8
    # ... and scheduling never changes a step's math: fp32 losses agree up to summation order.
    for steps in per_step[1:]:
        assert steps["loss"] == pytest.approx(per_step[0]["loss"], rel=1e-4)
    assert result["loss_max_rel_diff"] <= 1e-4
    # DP=1 x CP=4, and skrull's plans sharded some sequences over a 2-rank subgroup on the counted steps
    # (static_cp's never do): the mixed-degree runtime trained the same losses as the others
    assert (result["dp_size"], result["cp_size"]) == (1, 4)
    assert max(rows["skrull"]["per_step"]["subgroup_token_fraction"]) > 0, rows["skrull"]["per_step"]
    assert rows["static_cp"]["per_step"]["subgroup_token_fraction"] == [0.0] * COUNTED
    assert plot.stat().st_size > 0
    assert (Path(result["run_dir"]) / "bench_train.json").exists()


def test_unknown_policy_is_one_error_naming_the_valid_ones(tmp_path: Path, capsys) -> None:
    plot = tmp_path / "bench.png"
    argv = ["bench", "train", *TINY, "--set", f"run.storage_path={tmp_path / 'runs'}",
            "--policies", "skrull,static_cp_pakced", "--plot", str(plot)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--policies" in err and "'static_cp_pakced'" in err
    assert "static_cp_packed" in err and "gds_only" in err  # the registry's names
    assert not plot.exists() and not (tmp_path / "runs").exists()  # nothing half-written


def _record(policy: str, step: int, step_s: float, *, warmup: bool = False) -> dict:
    return {"policy": policy, "step": step, "warmup": warmup, "step_s": step_s, "tokens": 100,
            "predicted_step_s": math.nan, "planner_wait_s": 0.01, "compute_imbalance": 1.0,
            "rank_compute_s": [step_s, step_s / 2], "rank_cpu_s": [1.0, 1.0],
            "rank_predicted_busy_s": [0.5, 0.5], "rank_wait_s": [0.01, 0.01], "micro_batches": 2,
            "loss": 5.0, "sample_ids": [step], "torch_threads": 1}


def test_summary_medians_ratios_and_missing_baselines(tmp_path: Path) -> None:
    """Warm-up left out, medians, tokens/s from the median, null where a baseline or prediction is missing;
    the table and the plot cope with both."""
    records = [_record(p, 1, 100.0, warmup=True) for p in ("skrull", "sorted")]
    records += [_record("skrull", s, t) for s, t in ((2, 1.0), (3, 3.0), (4, 2.0))]
    records += [_record("sorted", s, t) for s, t in ((2, 4.0), (3, 4.0), (4, 5.0))]
    run = _run(records, ("skrull", "sorted"))
    summary = summarize(run)
    rows = summary["policies"]
    skrull = rows["skrull"]
    assert skrull["step_s_median"] == 2.0 and skrull["tokens_per_s"] == 50.0
    assert skrull["speedup_vs_sorted"] == 2.0 and rows["sorted"]["speedup_vs_sorted"] == 1.0
    assert skrull["speedup_vs_static_cp"] is None and skrull["speedup_vs_static_cp_packed"] is None
    assert skrull["predicted_step_s"] is None and skrull["prediction_error"] is None
    assert summary["stale_profile_warning"] is None  # nothing predicted: nothing to compare
    assert skrull["busy_s_per_rank"] == [2.0, 1.0] and skrull["busy_imbalance"] == pytest.approx(4 / 3)
    assert skrull["paired_speedup_vs_sorted"] == 2.5  # median of 4/1, 4/3, 5/2
    assert "skrull: 2.00x vs sorted" in format_report(summary)
    assert json.loads(json.dumps(jsonable(summary)))["policies"]["skrull"]["predicted_step_s"] is None
    plot_bench(summary, str(tmp_path / "summary.png"))
    assert (tmp_path / "summary.png").stat().st_size > 0


def _run(records: list[dict], policies: tuple[str, ...], distinct: int = 100) -> SimpleNamespace:
    config = SimpleNamespace(parallel=SimpleNamespace(dp_size=1, cp_size=2),
                             scheduling=SimpleNamespace(bucket_size=64, global_batch_size=4,
                                                        calibration="off"),
                             hardware=SimpleNamespace(profile="cpu"),
                             data=SimpleNamespace(source="synthetic"))
    machine = {"cpus": 2, "load_avg_1_5_15_min": [1.0, 0.5, 0.2]}
    steps = len({r["step"] for r in records if not r["warmup"]})
    return SimpleNamespace(policies=policies, records=records, steps=steps, warmup_steps=0, wall_s=1.0,
                           run_dir="r", machine=machine, config=config, distinct_global_batches=distinct)


def test_steps_beyond_the_datas_distinct_batches_are_named_with_the_knob_that_adds_them() -> None:
    records = [_record("skrull", step, 1.0) for step in range(1, 6)]
    assert summarize(_run(records, ("skrull",), distinct=5))["repeated_samples_warning"] is None
    summary = summarize(_run(records, ("skrull",), distinct=3))
    warning = summary["repeated_samples_warning"]
    assert summary["distinct_global_batches"] == 3
    assert "5 steps (warm-up included) of 4 samples need 20 usable rows" in warning
    assert "from step 4 on" in warning and "data.num_samples" in warning and "--steps" in warning
    assert warning in format_report(summary)


@pytest.mark.parametrize(("factor", "stale"), [(3.0, True), (1 / 3, True), (1.25, False), (0.8, False)])
def test_a_profile_off_by_more_than_30_percent_is_named_with_the_command_that_refreshes_it(factor, stale):
    records = []
    for step, measured in enumerate((1.0, 2.0, 1.5, 1.2, 0.9), start=1):
        for policy in ("skrull", "sorted"):
            record = _record(policy, step, measured)
            records.append(record | {"predicted_step_s": measured * factor})
    summary = summarize(_run(records, ("skrull", "sorted")))
    warning = summary["stale_profile_warning"]
    assert (warning is not None) == stale
    if stale:
        assert "hardware.profile=cpu" in warning and "python -m app profile --config" in warning
        assert ("200% slower" if factor > 1 else "200% faster") in warning
        assert warning in format_report(summary)


def test_machine_drift_is_what_every_policy_shares_and_the_rest_is_each_policy_own_error() -> None:
    """A planted machine (every step n of every policy d[n] times slower than predicted) and one policy whose
    predictions are also off by e[n] of their own: the drift is d, the net error 0 for the exact policies and
    median |e| for the other; with two policies there is no drift to tell (a median of two is their mean)."""
    drift = (1.0, 1.2, 0.9, 1.1, 1.3)
    own = (0.05, -0.1, 0.2, 0.0, 0.3)
    records = []
    for policy in ("skrull", "sorted", "static_cp", "dynamic_cp"):
        for step, (d, e) in enumerate(zip(drift, own, strict=True), start=1):
            measured = 1.0 + step / 10
            predicted = measured / d * (1 + e if policy == "skrull" else 1.0)
            records.append(_record(policy, step, measured) | {"predicted_step_s": predicted})
    summary = summarize(_run(records, ("skrull", "sorted", "static_cp", "dynamic_cp")))
    assert summary["machine_drift"] == pytest.approx(drift)
    rows = summary["policies"]
    assert rows["sorted"]["prediction_abs_error_median_net_of_drift"] == pytest.approx(0.0, abs=1e-12)
    assert rows["skrull"]["prediction_abs_error_median_net_of_drift"] == pytest.approx(0.1)
    assert rows["sorted"]["prediction_abs_error_median"] == pytest.approx(1 / 0.9 - 1)  # raw: the drift
    assert "machine drift" in format_report(summary) and "-10% to +30%" in format_report(summary)
    two = summarize(_run([r for r in records if r["policy"] in ("skrull", "sorted")], ("skrull", "sorted")))
    assert two["machine_drift"] is None
    assert two["policies"]["skrull"]["prediction_abs_error_median_net_of_drift"] is None
    assert "machine drift" not in format_report(two)


def test_the_policy_order_rotates_each_step_so_every_policy_runs_first_in_turn() -> None:
    from workers.bench_loop import rotated

    names = ["skrull", "balanced_packed", "static_cp"]
    orders = [rotated(names, step) for step in range(1, 7)]
    assert orders[:3] == [names, names[1:] + names[:1], names[2:] + names[:2]]
    assert orders[3:] == orders[:3]
    assert [order[0] for order in orders] == names * 2
