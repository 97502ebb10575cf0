"""Metrics you can watch: metrics.jsonl, mfu / padding_fraction, MLflow, and `report RUN_DIR`.

One tiny Ray training run (tests/conftest.py's `tiny_run`: tests/test_train_e2e.py's config, 6 steps, logged
to MLflow, shared with test_train_e2e and test_export) serves every end-to-end assertion: the run directory
alone must give `report` the history `train` returned, MLflow's own client must read back every step, and
`--plot` must write a PNG that matplotlib reads. A resumed run's MLflow run and `report`'s restart counts
are checked without Ray (MlflowLog and WorkerStartsLog twice on one directory).
Padding is checked exactly on hand-counted plans against the streams workers/batch.py really builds.
"""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from app.__main__ import main
from app.config import ConfigError, load_config
from app.rundir.files import METRICS_FILE, jsonable, read_jsonl
from scheduling import DacpPlan, StepPlan
from scheduling.payload import Cursor, Sample, build_rank_payloads, spare_payload
from tests.conftest import TINY_RUN_STEPS as STEPS
from workers.batch import build_rank_batch
from workers.metrics import computed_tokens, micro_batch_tokens
from workers.step import idle_batch

# --------------------------------------------------------------------------------------- padding (unit)


def _samples(lengths: list[int]) -> list[Sample]:
    return [Sample(sample_id=i, input_ids=np.arange(1, n + 1), labels=np.arange(1, n + 1))
            for i, n in enumerate(lengths)]


def _streamed_tokens(payload, cp_size: int) -> int:
    """Tokens of the streams workers/step.py runs: build_rank_batch, or its idle batch when empty."""
    total = 0
    for mb in payload.micro_batches:
        batch = build_rank_batch(mb.plan, mb.input_ids, mb.labels, cp_rank=payload.cp_rank, cp_size=cp_size)
        total += batch.num_tokens if batch.num_tokens else idle_batch(payload.cp_rank, cp_size).num_tokens
    return total


def test_computed_tokens_count_dacp_pads_and_idle_micro_batches_exactly() -> None:
    # CP 2 (2N = 4 chunks). Micro-batch 0: s0 (3 tokens) local on rank 0, s1 (5 tokens) distributed,
    # padded to 8 = 4 tokens per rank. Micro-batch 1: s2 (6 tokens) local on rank 0, rank 1 idle (1 token).
    # Rank 0: 3 + 4 + 6 = 13, rank 1: 4 + 1 = 5: 18 computed, 14 data tokens, 4 padding.
    plan = StepPlan(micro_batches=((DacpPlan(local=((0,), ()), distributed=(1,)),
                                    DacpPlan(local=((2,), ()), distributed=())),))
    payloads = build_rank_payloads(plan, _samples([3, 5, 6]), step=1, epoch=0, cursor=Cursor(epoch=0, rows=3),
                                   plan_ms=0.0)
    counts = [computed_tokens(payloads[0, r]) for r in range(2)]
    assert counts == [13, 5]
    assert [micro_batch_tokens(payloads[0, r]) for r in range(2)] == [[7, 6], [4, 1]]
    assert counts == [_streamed_tokens(payloads[0, r], 2) for r in range(2)]
    assert 1 - payloads[0, 0].global_tokens / sum(counts) == pytest.approx(4 / 18, abs=1e-12)
    # A spare rank runs one idle token per micro-batch.
    assert computed_tokens(spare_payload(payloads[0, 0], 0), spare=True) == 2


@pytest.mark.parametrize("length, cp_size", [(2, 2), (7, 2), (8, 2), (9, 4), (33, 4)])
def test_computed_tokens_equal_the_built_streams_of_a_distributed_sequence(length: int, cp_size: int) -> None:
    plan = StepPlan(micro_batches=((DacpPlan(local=((),) * cp_size, distributed=(0,)),),))
    payloads = build_rank_payloads(plan, _samples([length]), step=1, epoch=0, cursor=Cursor(epoch=0, rows=1),
                                   plan_ms=0.0)
    for rank in range(cp_size):
        assert computed_tokens(payloads[0, rank]) == _streamed_tokens(payloads[0, rank], cp_size)


# ------------------------------------------------------------------------------------ run files (unit)


def test_a_torn_last_line_is_left_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + '{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1, "loss": 2.0}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_a_set_mlflow_uri_without_mlflow_is_a_config_error_naming_the_key(monkeypatch) -> None:
    import importlib.util

    from app.sinks.mlflow import check_mlflow

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train\.mlflow_uri.*\.\[mlflow\]"):
        check_mlflow("http://tracking:5000")
    check_mlflow("")  # off: never needs mlflow


def test_report_on_a_directory_that_is_no_run_names_run_dir(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "RUN_DIR" in capsys.readouterr().err


# ------------------------------------------------------------------------------ MLflow and resumes (unit)


@pytest.fixture
def mlflow_file_store(tmp_path: Path, monkeypatch) -> str:
    # mlflow 3 refuses the file store unless asked (a local sqlite: store needs sqlalchemy + alembic).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file:{tmp_path / 'mlruns'}"


def test_a_resumed_run_continues_its_mlflow_run(tmp_path: Path, mlflow_file_store: str) -> None:
    from mlflow import MlflowClient

    from app.sinks.mlflow import MlflowLog

    run_dir = tmp_path / "run"
    config = load_config("configs/tiny-cpu.yaml").to_dict()
    first = MlflowLog(mlflow_file_store, run_dir, "run", config)
    first.write({"step": 1, "loss": 3.0, "session": "a", "grad_norm": float("nan")})
    first.close("KILLED")
    second = MlflowLog(mlflow_file_store, run_dir, "run", config)  # the rerun of the same run directory
    second.write({"step": 2, "loss": 2.5, "session": "b"})
    second.close()
    client = MlflowClient(tracking_uri=mlflow_file_store)
    (run,) = client.search_runs([client.get_experiment_by_name("skrull").experiment_id])
    assert second.run_id == first.run_id == run.info.run_id
    assert (run.info.run_name, run.info.status) == ("run", "FINISHED")
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in losses] == [(1, 3.0), (2, 2.5)]
    assert client.get_metric_history(run.info.run_id, "grad_norm") == []  # NaN is left out
    assert run.data.params["scheduling.bucket_size"] == "1024"


def test_a_uri_mlflow_refuses_is_a_config_error_and_writes_nothing(tmp_path: Path) -> None:
    from app.sinks.mlflow import MlflowLog

    with pytest.raises(ConfigError, match=r"train\.mlflow_uri='bogus://x'"):
        MlflowLog("bogus://x", tmp_path / "run", "run", {})
    assert not (tmp_path / "run").exists()


def test_report_counts_restarts_within_a_train_call_and_resumes_across_calls(tmp_path: Path) -> None:
    from app.rundir.snapshot import write_snapshot
    from app.sinks.run_log import RunLog, WorkerStartsLog
    from app.train.report import report_lines, run_report

    write_snapshot(load_config("configs/tiny-cpu.yaml"), tmp_path, template=None)
    log = RunLog(tmp_path)
    first, second = WorkerStartsLog(tmp_path, total_steps=4), WorkerStartsLog(tmp_path, total_steps=4)
    for starts, session, resumed in ((first, "a", 0), (first, "b", 2), (second, "c", 3)):
        starts.write({"session": session, "resumed_from_step": resumed})
    for step, session in ((1, "a"), (2, "a"), (3, "a"), (3, "b"), (4, "c")):  # b re-trained step 3
        opens = (step, session) in ((1, "a"), (3, "b"), (4, "c"))  # each start's first reported step
        first = {"engine_s": 5.0 + step, "warmup_s": 0.5} if opens else {}
        log.write({"step": step, "loss": 10.0 - step, "session": session, "tokens": 100, "step_s": 1.0,
                   **first})
    report = run_report(tmp_path)
    assert (report["starts"], report["restarts"], report["resumes"]) == (3, 1, 1)
    assert [(u["step"], u["engine_s"]) for u in report["start_ups"]] == [(1, 6.0), (3, 8.0), (4, 9.0)]
    assert "start-up  engine 9.0 s, warm-up 0.5 s before step 4 (the newest of 3 starts)" in \
        "\n".join(report_lines(report))
    assert [h["session"] for h in report["history"]] == ["a", "a", "b", "c"]
    assert (report["status"], report["tokens"], report["tokens_per_s"]) == ("finished", 400, 100.0)
    assert report["predicted_step_s_median"] is None and report["profile_ratio"] is None  # not recorded


def test_report_says_when_the_profile_predicted_steps_far_off(tmp_path: Path) -> None:
    from app.rundir.snapshot import write_snapshot
    from app.sinks.run_log import RunLog, WorkerStartsLog
    from app.train.report import report_lines, run_report

    write_snapshot(load_config("configs/tiny-cpu.yaml"), tmp_path, template=None)
    log = RunLog(tmp_path)
    WorkerStartsLog(tmp_path, total_steps=3).write({"session": "a", "resumed_from_step": 0})
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0, "session": "a", "tokens": 100, "step_s": 2.0,
                    "predicted_step_s": 0.5})
    report = run_report(tmp_path)
    assert (report["predicted_step_s_median"], report["profile_ratio"]) == (0.5, 0.25)
    assert "step 2 s (profile predicted 0.5 s: stale)" in "\n".join(report_lines(report))


# ---------------------------------------------------------------------------------------- one Ray run


def _report(run_dir: Path, *flags: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["report", str(run_dir), *flags]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def watched_run(tiny_run):
    """The shared 6-step run logged to MLflow: (its summary, the MLflow URI)."""
    return tiny_run


def test_metrics_jsonl_holds_every_step_with_mfu_and_padding(watched_run) -> None:
    summary, _ = watched_run
    records = read_jsonl(Path(summary.run_dir) / METRICS_FILE)
    assert records == jsonable(summary.history) and len(records) == STEPS
    for record in records:
        assert 0 < record["mfu"] <= 1, record["mfu"]
        assert 0 <= record["padding_fraction"] < 1, record["padding_fraction"]
        # DP 1 x CP 2: every rank's busy time, none of them spare
        assert len(record["rank_compute_s"]) == 2 and min(record["rank_compute_s"]) > 0
        assert record["compute_imbalance"] == pytest.approx(
            max(record["rank_compute_s"]) / np.mean(record["rank_compute_s"]), rel=1e-9)
        assert record["predicted_step_s"] > 0  # the profile's time of the step's plan (stale-profile check)


def test_report_json_is_the_runs_history_from_the_run_directory_alone(watched_run, tmp_path: Path) -> None:
    summary, _ = watched_run
    run_dir = Path(summary.run_dir)
    copy = tmp_path / run_dir.name  # the directory alone, without the Ray session that wrote it
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoint_*"))
    report = json.loads(_report(copy, "--json"))
    assert report["history"] == jsonable(summary.history)
    assert (report["status"], report["steps"], report["last_step"], report["total_steps"]) == \
        ("finished", STEPS, STEPS, STEPS)
    assert (report["starts"], report["restarts"], report["resumes"]) == (1, 0, 0)
    assert (report["tokens"], report["samples"]) == (summary.tokens, summary.samples)
    assert (report["loss_first"], report["loss_last"]) == (summary.loss_first, summary.loss_last)
    lrs = [h["lr"] for h in summary.history]
    assert (report["lr_first"], report["lr_last"], report["lr_max"]) == (lrs[0], lrs[-1], max(lrs))
    assert report["tokens_per_s"] == pytest.approx(summary.tokens_per_s, rel=1e-12)
    assert report["planner_ahead_steps_min"] == min(h["planner_ahead_steps"] for h in summary.history)
    assert report["data"]["usable_rows"] == 24
    assert report["data"]["line"].startswith("data: 24/24 rows usable")

    # A running run: a record caught mid-write is not read; the complete prefix is.
    with (copy / METRICS_FILE).open("a") as out:
        out.write(f'{{"step": {STEPS + 1}, "loss": 1.')
    running = json.loads(_report(copy, "--json"))
    assert running["history"] == jsonable(summary.history)

    text = _report(copy)
    assert f"run {run_dir.name}: finished, step {STEPS} of {STEPS}" in text
    assert "restarts  0 (1 worker-group starts, 0 resumes)" in text
    engine_s = summary.history[0]["engine_s"]
    warmup_s = summary.history[0]["warmup_s"]
    assert report["start_ups"] == [{"step": 1, "engine_s": engine_s, "warmup_s": warmup_s}]
    assert f"start-up  engine {engine_s:.1f} s, warm-up " in text and engine_s > 0
    assert f"lr        {lrs[0]:.3g} -> {lrs[-1]:.3g} (max {max(lrs):.3g})" in text
    assert len(text.splitlines()) <= 24  # one screen


DRIVER_PHASES = ["preflight", "ray_start", "data", "planner", "workers", "shutdown", "export", "finish"]
"""TrainSummary.phases_s's keys, in their order (app/train/driver.py)."""


def test_the_summary_and_the_records_split_the_wall_time(watched_run) -> None:
    """`train --json`'s phases_s: the driver's own split of wall_s, every phase measured and their sum
    within it; the first step's engine_phases_s adds up to its engine_s; the last step, the one that saved
    the checkpoint, carries checkpoint_s (no other step does); metrics.jsonl keeps both."""
    summary, _ = watched_run
    public = summary.to_json_dict()
    phases = public["phases_s"]
    assert list(phases) == DRIVER_PHASES and phases == summary.phases_s
    assert all(isinstance(v, float) and v >= 0 for v in phases.values()), phases
    assert phases["workers"] > 0 and sum(phases.values()) <= public["wall_s"] + 0.05
    first, last = summary.history[0], summary.history[-1]
    engine = first["engine_phases_s"]
    assert list(engine)[:2] == ["import", "model"] and list(engine)[-2:] == ["deepspeed", "other"]
    assert all(v >= 0 for v in engine.values()) and engine["model"] > 0 and engine["deepspeed"] > 0
    assert sum(engine.values()) == pytest.approx(first["engine_s"], abs=1e-6)
    assert last["checkpoint_s"] > 0 and not any("checkpoint_s" in h for h in summary.history[:-1])
    inside = sum(h["step_s"] for h in summary.history) + first["engine_s"] + first["warmup_s"] + \
        last["checkpoint_s"]
    assert phases["workers"] > inside  # the worker group's whole life is inside the driver's fit
    records = read_jsonl(Path(summary.run_dir) / METRICS_FILE)
    assert records[0]["engine_phases_s"] == engine and records[-1]["checkpoint_s"] == last["checkpoint_s"]


def test_report_plot_writes_a_png(watched_run, tmp_path: Path) -> None:
    import matplotlib.image

    png = tmp_path / "run.png"
    _report(Path(watched_run[0].run_dir), "--plot", str(png))
    image = matplotlib.image.imread(png)  # matplotlib's own PNG reader
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 400


def test_mlflow_has_the_config_and_every_step(watched_run) -> None:
    from mlflow import MlflowClient

    summary, uri = watched_run
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("skrull").experiment_id])
    assert run.info.run_name == Path(summary.run_dir).name and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.003" and run.data.params["parallel.cp_size"] == "2"
    for key in ("loss", "mfu", "padding_fraction", "tokens_per_s_per_worker", "lr"):
        logged = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in logged] == [h["step"] for h in summary.history], key
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.value for m in losses] == pytest.approx(summary.losses, rel=1e-12)
    lrs = client.get_metric_history(run.info.run_id, "lr")
    assert [m.value for m in lrs] == pytest.approx([h["lr"] for h in summary.history], rel=1e-12)


def test_a_bad_override_of_the_mlflow_uri_is_rejected() -> None:
    with pytest.raises(ConfigError, match="train.mlflow_uri"):
        load_config("configs/tiny-cpu.yaml", ["train.mlflow_uri=5"])
