"""A run never collides with another, never escapes its storage, never echoes a secret, and knows what it
trained on: the run lock, run.name, URI secrets, the data fingerprint, a rerun with nothing to resume.

All in-process and without Ray (the object-store half of the lock is in tests/test_s3_storage.py, SIGTERM
and the loopback-only embedded Ray in tests/test_embedded_run.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.__main__ import main
from app.config import ConfigError, DataConfig, load_config
from app.data.fingerprint import HEAD_TAIL_BYTES, data_fingerprint
from app.data.readers import resolve_source
from app.rundir.files import CONFIG_SNAPSHOT, DATA_SNAPSHOT
from app.rundir.lock import LOCK_FILE, FileLock, RunLocked, run_lock
from app.rundir.snapshot import check_resume, write_snapshot
from app.train.preflight import preflight
from workers.storage import Location, redact_text, redact_uri

REPO = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-VALUE-42"


def _train_args(tmp_path: Path, *overrides: str) -> list[str]:
    base = [f"run.storage_path={tmp_path}", "run.name=safe", "train.steps=1", "data.num_samples=24",
            "data.length_scale=0.1", "scheduling.global_batch_size=8"]
    return ["train", "--config", "configs/tiny-cpu.yaml", "--no-progress",
            *[arg for o in (*base, *overrides) for arg in ("--set", o)]]


# -- run.name: one path component --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../escape", "a/b", ".", "..", "/abs", "x\\y", "sp ace", "a\nb"])
def test_a_run_name_that_is_not_one_path_component_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=r"run\.name=.* must be one path component"):
        load_config("configs/tiny-cpu.yaml", [f"run.name={json.dumps(name)}"])


def test_ordinary_run_names_load() -> None:
    for name in ("skrull-run", "exp_1.2-b", "", "a..b"):
        assert load_config("configs/tiny-cpu.yaml", [f"run.name={name}"]).run.name == name


def test_the_traversal_probe_exits_2_and_writes_nothing(tmp_path: Path, capsys) -> None:
    storage = tmp_path / "a" / "b"
    assert main(_train_args(storage, "run.name=../../escape")) == 2
    assert "run.name" in capsys.readouterr().err
    assert list(tmp_path.rglob("*")) == []


# -- secrets -----------------------------------------------------------------------------------------------
def _files_mentioning(root: Path, text: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and text in p.read_text(errors="replace")]


@pytest.mark.parametrize(("override", "knob"), [
    (f"run.storage_path=s3://AKIAEXAMPLE:{SECRET}@bucket/runs", "run.storage_path"),
    (f"data.path=s3://bucket/train.parquet?endpoint_override=127.0.0.1:9&scheme=http&secret_key={SECRET}",
     "data.path"),
])
def test_the_secret_probes_exit_2_naming_the_knob_and_never_echo_the_secret(
        tmp_path: Path, capsys, override: str, knob: str) -> None:
    """The issue's two probes through the CLI: credentials in a URI's userinfo or query."""
    code = main(_train_args(tmp_path, "data.path=unused.parquet", "data.source=path", override))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert f"{knob}=" in err and "AWS_ACCESS_KEY_ID" in err and "***" in err
    assert SECRET not in out + err
    assert _files_mentioning(tmp_path, SECRET) == []


def test_pyarrows_error_text_is_scrubbed_of_the_uri_secret() -> None:
    """pyarrow refuses a secret_key query parameter with a message that repeats it; the DataError (and so
    anything that prints it) carries *** instead."""
    data = DataConfig(source="path", path=f"s3://bucket/x.parquet?secret_key={SECRET}&scheme=http")
    with pytest.raises(ConfigError, match=r"data\.path=") as caught:
        resolve_source(data)
    assert SECRET not in str(caught.value) and "secret_key=***" in str(caught.value)


def test_redaction_hides_userinfo_and_secret_query_values_everywhere() -> None:
    uri = f"s3://AKIA:{SECRET}@b/runs?endpoint_override=h:1&session_token={SECRET}x"
    assert redact_uri(uri) == "s3://***@b/runs?endpoint_override=h:1&session_token=***"
    text = f"failed on b/runs ({SECRET}x) and {SECRET} in {uri}"
    assert SECRET not in redact_text(text, uri)
    assert SECRET not in redact_text(f"'{uri}'") and "endpoint_override=h:1" in redact_text(uri)
    assert redact_uri("/local/path@x") == "/local/path@x"


def test_the_snapshot_holds_no_secret_and_resume_compares_redacted_uris(tmp_path: Path) -> None:
    """A URI's secret never reaches skrull_config.json; the math-key check compares URIs as redacted, so
    a run snapshotted with a secret (before redaction existed) still resumes."""
    config = load_config("configs/tiny-cpu.yaml",
                         ["data.source=path", f"data.path=s3://b/d.parquet?secret_key={SECRET}"])
    write_snapshot(config, tmp_path, template=None)
    assert SECRET not in (tmp_path / CONFIG_SNAPSHOT).read_text()
    _record_checkpoint(tmp_path, step=1)
    check_resume(config, tmp_path)
    (tmp_path / CONFIG_SNAPSHOT).write_text(json.dumps(config.to_dict()))  # an older, unredacted snapshot
    check_resume(config, tmp_path)


# -- a rerun with nothing to resume ------------------------------------------------------------------------
def _record_checkpoint(run_dir: Path, step: int) -> None:
    """What Ray Train's controller writes once a checkpoint of `step` is complete (app/rundir/snapshot.py
    recorded_step reads it)."""
    (run_dir / "checkpoint_manager_snapshot.json").write_text(
        json.dumps({"checkpoint_results": [{"metrics": {"step": step}}]}))


def test_a_rerun_without_a_checkpoint_starts_fresh_with_its_new_config(tmp_path: Path) -> None:
    """Probe 9: the first call (a vocabulary that did not fit) failed before any checkpoint; the fixed
    rerun is not a resume: no math check, and its config replaces the snapshot."""
    failed = load_config("configs/tiny-cpu.yaml", ["model.vocab_size=1000"])
    fixed = load_config("configs/tiny-cpu.yaml")
    write_snapshot(failed, tmp_path, template=None)
    assert check_resume(fixed, tmp_path) is False
    assert write_snapshot(fixed, tmp_path, template=None, fresh=True) is True  # replaced (the caller says so)
    assert json.loads((tmp_path / CONFIG_SNAPSHOT).read_text())["model"]["vocab_size"] == 0
    _record_checkpoint(tmp_path, step=2)  # once a checkpoint exists, the math is the run's
    with pytest.raises(ConfigError, match=r"model\.vocab_size: 0 -> 1000"):
        check_resume(failed, tmp_path)
    assert check_resume(fixed, tmp_path) is True
    # a resume keeps the first snapshot
    assert write_snapshot(failed, tmp_path, template=None, fresh=False) is False
    assert json.loads((tmp_path / CONFIG_SNAPSHOT).read_text())["model"]["vocab_size"] == 0


# -- the data a run trained on -----------------------------------------------------------------------------
def _write_parquet(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)


def test_data_regenerated_under_the_same_path_is_refused_on_resume(tmp_path: Path) -> None:
    """Probe 3: same data.path, other rows -> exit 2 naming data.path, unless train.allow_config_change;
    data.eval_path likewise. A run snapshotted before fingerprints resumes as before."""
    data, evals, run = tmp_path / "data", tmp_path / "eval.jsonl", tmp_path / "run"
    _write_parquet(data / "part-0.parquet", [f"row {i}" for i in range(20)])
    evals.write_text("".join(json.dumps({"text": f"eval {i}"}) + "\n" for i in range(4)))
    overrides = ["data.source=path", f"data.path={data}", f"data.eval_path={evals}"]
    config = load_config("configs/tiny-cpu.yaml", overrides)
    fingerprints = preflight(config).fingerprints
    assert set(fingerprints) == {"data.path", "data.eval_path"}
    write_snapshot(config, run, template=None, data=fingerprints)
    _record_checkpoint(run, step=2)
    assert check_resume(config, run, preflight(config).fingerprints) is True  # nothing changed

    _write_parquet(data / "part-0.parquet", [f"new row {i}" for i in range(20)])
    with evals.open("a") as more:
        more.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(ConfigError, match=r"data\.path: the data changed \(part-0\.parquet changed .*"
                                          r"data\.eval_path: the data changed .*allow_config_change"):
        check_resume(config, run, preflight(config).fingerprints)
    allowed = load_config("configs/tiny-cpu.yaml", [*overrides, "train.allow_config_change=true"])
    assert check_resume(allowed, run, preflight(allowed).fingerprints) is True
    (run / DATA_SNAPSHOT).unlink()  # a run from before fingerprints
    assert check_resume(config, run, preflight(config).fingerprints) is True


def test_the_fingerprint_reads_a_files_head_and_tail_only(tmp_path: Path) -> None:
    """Files added, removed, resized, or changed near either end show; a large file is never read whole
    (its middle is outside the hash: the stated cost bound)."""
    data = DataConfig(source="path", path=str(tmp_path), format="jsonl")
    big = tmp_path / "a.jsonl"
    line = json.dumps({"text": "x" * 1000}) + "\n"
    big.write_text(line * (4 * HEAD_TAIL_BYTES // len(line)))

    def fingerprint() -> dict:
        return data_fingerprint(data, resolve_source(data))

    before = fingerprint()
    assert [row[:2] for row in before["files"]] == [["a.jsonl", big.stat().st_size]]
    raw = bytearray(big.read_bytes())
    raw[len(raw) // 2] = ord("y")  # same size, in the unread middle: not seen (documented)
    big.write_bytes(bytes(raw))
    assert fingerprint() == before
    raw[-10] = ord("y")  # near the end: seen
    big.write_bytes(bytes(raw))
    assert fingerprint() != before
    (tmp_path / "b.jsonl").write_text(line)
    assert [row[0] for row in fingerprint()["files"]] == ["a.jsonl", "b.jsonl"]
    synthetic = data_fingerprint(DataConfig(num_samples=7), None)
    assert synthetic["source"] == "synthetic" and synthetic["num_samples"] == 7


# -- one writer per run: the local lock --------------------------------------------------------------------
def test_a_second_holder_of_a_local_run_is_refused_naming_the_first(tmp_path: Path) -> None:
    run = Location.of(tmp_path / "run")
    holder = rf"host {socket.gethostname()}, pid {os.getpid()}, started "
    with run_lock(run), pytest.raises(RunLocked, match=holder):
        FileLock(run, out=sys.stderr).acquire()
    with run_lock(run):  # released: taken again, and no takeover warning
        pass
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""


def test_the_lock_of_a_dead_holder_is_taken_over_with_a_warning(tmp_path: Path, capsys) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    run = tmp_path / "run"
    run.mkdir()
    holder = {"host": socket.gethostname(), "pid": gone.pid, "started": "2026-01-01T00:00:00"}
    (run / LOCK_FILE).write_text(json.dumps(holder))  # written by a holder that was killed
    with run_lock(Location.of(run)):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert "taking over the lock" in err and f"pid {gone.pid}" in err


def test_a_second_train_cli_on_a_locked_run_exits_2_at_once(tmp_path: Path) -> None:
    """The lock held by this process; a `train` process on the same run stops before Ray starts."""
    run = Location.of(tmp_path / "held")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with run_lock(run):
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "app", *_train_args(tmp_path, "run.name=held")],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"pid {os.getpid()}" in result.stderr and "run.name" in result.stderr
    assert elapsed < 60 and "Ray" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "held").iterdir()) == [LOCK_FILE]  # nothing else written
