"""The W&B sink (app/sinks/wandb.py) offline, without Ray and without a network.

WANDB_MODE=offline writes a run's whole record to <run_dir>/wandb/offline-run-*/run-<id>.wandb, the
transaction log `wandb sync` uploads later. This wandb version ships no Python reader for it, so
`transaction_log` below reads its format: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
LevelDB-log records in 32 KiB blocks (4-byte CRC32 of the type byte then the data, 2-byte length, 1-byte
type FULL/FIRST/MIDDLE/LAST; a block tail under 7 bytes is padding), each whole record a serialized
wandb_internal Record protobuf. The tests read back the run record (id, name, config), every history row
(step and values) and the exit record.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from app.config import ConfigError, load_config

wandb = pytest.importorskip("wandb")

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> list[tuple[int, bytes]]:
    """(type, data) of every LevelDB-log chunk after the file header, each one's CRC checked."""
    assert data[:_HEADER] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), data[:_HEADER]
    chunks, position = [], _HEADER
    while len(data) - position >= _HEADER:
        left = _BLOCK - position % _BLOCK
        if left < _HEADER:  # a block's padded tail
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + _HEADER])
        if (checksum, length, kind) == (0, 0, 0):  # zero fill at the end of a flushed block
            break
        body = data[position + _HEADER:position + _HEADER + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == checksum, f"bad CRC at byte {position}"
        chunks.append((kind, body))
        position += _HEADER + length
    return chunks


def transaction_log(path: Path) -> list[Any]:
    """Every Record of a .wandb file, in order (FIRST + MIDDLE... + LAST chunks joined)."""
    from wandb.proto import wandb_internal_pb2

    records, pending = [], b""
    for kind, body in _chunks(path.read_bytes()):
        pending += body
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def offline_runs(run_dir: Path) -> list[list[Any]]:
    """The records of each offline run folder under run_dir/wandb, oldest first (wandb names a second
    folder of the same id and second `<name>-1`), read once W&B's process has exited: run.finish() can
    return before that process has written the last of its buffered log."""
    wandb.teardown()
    return [transaction_log(path) for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))]


def of_type(records: list[Any], kind: str) -> list[Any]:
    return [getattr(record, kind) for record in records if record.WhichOneof("record_type") == kind]


def config_of(records: list[Any]) -> dict[str, Any]:
    """The run record's config (W&B's own `_wandb` entry left out)."""
    (run,) = of_type(records, "run")
    return {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}


def history_of(records: list[Any]) -> dict[int, dict[str, Any]]:
    """{step: {metric: value}} of every history row (W&B's _step, _runtime, _timestamp left out)."""
    rows = {}
    for history in of_type(records, "history"):
        values = {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in history.item}
        assert values.pop("_step") == history.step.num
        rows[history.step.num] = {key: value for key, value in values.items() if not key.startswith("_")}
    return rows


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """W&B offline and silent, its settings and caches under tmp_path, no credentials anywhere; W&B's
    process-wide state (it reads the environment once) is torn down after the test."""
    import os

    for name in [name for name in os.environ if name.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    state = tmp_path / "wandb_state"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("NETRC", str(state / "netrc"))  # no ~/.netrc login is read
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
        monkeypatch.setenv(name, str(state / name.lower()))
    wandb.teardown()
    yield
    wandb.teardown()


STEPS = [{"step": step, "loss": 4.0 - step, "lr": 1e-3 * step, "session": "a", "warmup": False,
          "grad_norm": float("nan") if step == 2 else 0.5 * step, "rank_compute_s": [1.0, 2.0]}
         for step in (1, 2, 3)]


def test_an_offline_run_holds_the_config_and_every_steps_metrics(tmp_path: Path, offline_wandb) -> None:
    from app.sinks.wandb import WandbLog

    run_dir, config = tmp_path / "run", load_config("configs/tiny-cpu.yaml").to_dict()
    log = WandbLog("skrull-test", "", run_dir, "tiny", config)
    for record in STEPS:
        log.write(record)
    log.write(STEPS[1] | {"loss": -1.0})  # a restarted group's re-trained step 2: W&B keeps the first
    log.write({"step": 4, "loss": 0.0, "lr": 4e-3})
    log.close()
    (records,) = offline_runs(run_dir)
    (run,) = of_type(records, "run")
    assert (run.run_id, run.display_name, run.project) == (log.run_id, "tiny", "skrull-test")
    assert config_of(records) == json.loads(json.dumps(config))
    assert config_of(records)["train"]["lr"] == 0.003
    history = history_of(records)
    assert list(history) == [1, 2, 3, 4]
    for record in STEPS:
        assert history[record["step"]]["loss"] == record["loss"]
        assert history[record["step"]]["lr"] == pytest.approx(record["lr"], rel=1e-12)
        assert "session" not in history[record["step"]] and "rank_compute_s" not in history[record["step"]]
    assert "grad_norm" not in history[2] and history[3]["grad_norm"] == 1.5  # NaN left out
    assert history[4] == {"loss": 0.0, "lr": 4e-3}
    assert [exit_record.exit_code for exit_record in of_type(records, "exit")] == [0]


def test_a_rerun_of_the_run_directory_continues_the_same_run_id(tmp_path: Path, offline_wandb) -> None:
    from app.sinks.wandb import WandbLog

    run_dir = tmp_path / "run"
    first = WandbLog("skrull-test", "", run_dir, "tiny", {"train": {"lr": 0.003}})
    first.write(STEPS[0])
    first.close("KILLED")
    second = WandbLog("skrull-test", "", run_dir, "tiny", {"train": {"lr": 0.003}})
    second.write(STEPS[1])
    second.close()
    assert second.run_id == first.run_id
    assert json.loads((run_dir / "wandb_run.json").read_text())["run_id"] == first.run_id
    earlier, later = offline_runs(run_dir)
    assert [run.run_id for run in of_type(earlier + later, "run")] == [first.run_id] * 2
    assert list(history_of(earlier)) == [1] and list(history_of(later)) == [2]
    assert [record.exit_code for record in of_type(earlier + later, "exit")] == [1, 0]
    other = WandbLog("another-project", "", run_dir, "tiny", {})  # another project: a new W&B run
    other.close()
    assert other.run_id != first.run_id


def test_a_set_project_without_wandb_is_a_config_error_naming_the_key(monkeypatch) -> None:
    import importlib.util

    from app.sinks.wandb import check_wandb

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train\.wandb_project='p'.*\.\[wandb\]"):
        check_wandb("p")
    check_wandb("")  # off: never needs wandb


def test_online_without_credentials_is_a_config_error_not_a_prompt(tmp_path: Path, offline_wandb,
                                                                     monkeypatch) -> None:
    from app.sinks.wandb import WandbLog

    monkeypatch.setenv("WANDB_MODE", "online")
    wandb.teardown()  # W&B reads the environment once per process
    with pytest.raises(ConfigError, match=r"train\.wandb_project='p': no W&B credentials"):
        WandbLog("p", "", tmp_path / "run", "run", {})
    assert not (tmp_path / "run").exists()


def test_a_failing_write_warns_once_and_training_goes_on(tmp_path: Path, offline_wandb, monkeypatch) -> None:
    from app.sinks.wandb import WandbLog

    out = io.StringIO()
    log = WandbLog("skrull-test", "", tmp_path / "run", "run", {}, out=out)
    calls = []

    def broken(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        raise ConnectionError("W&B is down\nmore lines")

    monkeypatch.setattr(log._run, "log", broken)
    for record in STEPS:
        log.write(record)
    log.close("FAILED")
    assert len(calls) == 1
    assert out.getvalue() == ("warning: W&B logging stopped (train.wandb_project): ConnectionError: W&B is "
                              "down; metrics.jsonl and TensorBoard keep every step\n")


def test_a_training_run_logs_its_config_and_every_step_to_wandb(tiny_run) -> None:
    """The suite's shared Ray run (tests/conftest.py `tiny_run`: train.wandb_project, WANDB_MODE=offline)."""
    from app.rundir.files import CONFIG_SNAPSHOT

    summary, _ = tiny_run
    run_dir = Path(summary.run_dir)
    (records,) = offline_runs(run_dir)
    (run,) = of_type(records, "run")
    assert (run.display_name, run.project) == (run_dir.name, "skrull-tests")
    assert run.run_id == json.loads((run_dir / "wandb_run.json").read_text())["run_id"]
    assert config_of(records) == json.loads((run_dir / CONFIG_SNAPSHOT).read_text())
    history = history_of(records)
    assert list(history) == [record["step"] for record in summary.history]
    for record in summary.history:
        for key in ("loss", "lr", "mfu", "tokens_per_s"):
            if key in record:
                assert history[record["step"]][key] == pytest.approx(record[key], rel=1e-12), key
    assert "lr" in history[1]
    assert [exit_record.exit_code for exit_record in of_type(records, "exit")] == [0]
