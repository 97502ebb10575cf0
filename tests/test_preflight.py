"""Pre-flight: each mistake fails before any worker starts, with exit code 2, one message naming the knob,
and nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from app.__main__ import main
from app.config import ConfigError, load_config
from app.rundir.files import CONFIG_SNAPSHOT
from app.rundir.location import run_name
from app.rundir.snapshot import check_resume

REPO = Path(__file__).resolve().parent.parent


def _train_args(tmp_path: Path, *overrides: str) -> list[str]:
    base = [f"run.storage_path={tmp_path}", "run.name=bad", "train.steps=1", "data.num_samples=24",
            "data.length_scale=0.1", "scheduling.global_batch_size=8"]
    return ["train", "--config", "configs/tiny-cpu.yaml", "--no-progress",
            *[arg for o in (*base, *overrides) for arg in ("--set", o)]]


def test_a_typo_in_a_hub_style_model_name_fails_in_seconds(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    assert main(_train_args(tmp_path, "model.name_or_path=tiny-qwen3")) == 2
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert "model.name_or_path='tiny-qwen3'" in err and "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "bad").exists()


def test_an_empty_config_file_is_an_error(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert main(["train", "--config", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_an_unwritable_output_path_is_an_error(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    assert main(_train_args(tmp_path, f"run.storage_path={a_file / 'runs'}")) == 2
    assert "run.storage_path" in capsys.readouterr().err


def test_a_broken_hardware_profile_is_an_error(tmp_path: Path, capsys) -> None:
    profile = tmp_path / "dup.yaml"
    profile.write_text("name: dup\nmfu: 0.3\nmfu: 0.4\n")
    assert main(_train_args(tmp_path, f"hardware.profile={profile}")) == 2
    assert "duplicate key 'mfu'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_a_gpu_profile_cannot_size_a_local_cpu_runs_bucket(tmp_path: Path, capsys, monkeypatch) -> None:
    """scheduling.bucket_size=auto on CPU workers with hardware.profile=h100 (80 GB): exit 2 naming the
    knobs before Ray starts, where C would have been sized for 80 GB on this host. The CPU profile (24 GB)
    on a host of that size, a set C, or a cluster at RAY_ADDRESS: no error from this check."""
    import app.train.preflight as preflight

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: int(24 * 2**30))
    sets = ["--set", "scheduling.bucket_size=auto", "--set", f"run.storage_path={tmp_path}"]
    started = time.monotonic()
    assert main(["train", "--config", "configs/tiny-cpu.yaml", *sets, "--set", "hardware.profile=h100"]) == 2
    err = capsys.readouterr().err
    assert "hardware.profile=h100's 80.0 GB" in err and "this host has 25.8 GB" in err
    assert "scheduling.bucket_size" in err and time.monotonic() - started < 30
    assert not (tmp_path / "runs").exists() and not list(tmp_path.iterdir())  # nothing written
    for fine in (["hardware.profile=cpu"], ["hardware.profile=h100", "scheduling.bucket_size=1024"]):
        config = load_config("configs/tiny-cpu.yaml", [f"run.storage_path={tmp_path}",
                                                       "scheduling.bucket_size=auto", *fine])
        preflight.check_local_cpu_memory(config)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster: its nodes' memory is not this host's
    preflight.check_local_cpu_memory(load_config("configs/tiny-cpu.yaml", [
        "scheduling.bucket_size=auto", "hardware.profile=h100"]))


def test_set_errors_name_the_override_not_the_file(capsys) -> None:
    assert main(["plan", "--config", "configs/tiny-cpu.yaml", "--set", "model.dtype=fp16"]) == 2
    err = capsys.readouterr().err
    assert "--set model.dtype=fp16" in err and "tiny-cpu.yaml" not in err
    unsafe = "x=!!python/object/apply:os.getcwd []"
    assert main(["plan", "--config", "configs/tiny-cpu.yaml", "--set", unsafe]) == 2
    assert "--set x=" in capsys.readouterr().err


def test_run_names_are_unique_within_a_second() -> None:
    config = load_config(None, ["run.name="])
    names = {run_name(config) for _ in range(20)}
    assert len(names) == 20 and all(n.startswith("skrull-") for n in names)


def test_verify_asks_for_force_beyond_this_machines_memory(capsys) -> None:
    assert main(["verify", "--cp", "2", "--lengths", "20000000"]) == 2
    err = capsys.readouterr().err
    assert "estimated peak memory" in err and "--force" in err


@pytest.mark.slow
def test_more_cpus_than_the_machine_has_fails_fast(tmp_path: Path) -> None:
    """resources.cpus_per_worker=4 on an embedded Ray of 4 logical CPUs: one error, not a retry loop, and
    before that Ray starts (its size is known from the config)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray"))  # short: Ray's socket paths live below it
    env["RAY_TMPDIR"] = str(ray_tmp)  # where a Ray that started would leave its session directory
    command = [sys.executable, "-m", "app", *_train_args(tmp_path, "resources.cpus_per_worker=4",
                                                          "resources.num_cpus=4")]
    started = time.monotonic()
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert time.monotonic() - started < 120
    assert "resources.cpus_per_worker" in result.stderr and "parallel.num_workers" in result.stderr
    assert not (tmp_path / "bad").exists()
    assert not list(ray_tmp.rglob("session_*")), "a Ray was started before the error"
    shutil.rmtree(ray_tmp)


@pytest.mark.slow
def test_a_global_batch_larger_than_an_epoch_is_an_error(local_ray, tmp_path: Path) -> None:
    from app.train.driver import train

    config = load_config("configs/tiny-cpu.yaml", [
        f"run.storage_path={tmp_path}", "run.name=big", "data.num_samples=10", "data.length_scale=0.1",
        "scheduling.global_batch_size=16", "train.steps=1"])
    with pytest.raises(ConfigError, match=r"global_batch_size=16 is larger than the 10 usable rows"):
        train(config, progress=False)
    assert not (tmp_path / "big").exists()


def test_resume_compares_math_keys_and_a_key_newer_than_the_run_is_its_default(tmp_path: Path) -> None:
    config = load_config("configs/tiny-cpu.yaml", ["train.steps=4"])
    old = config.to_dict()
    del old["data"]["eval_fraction"], old["model"]["lora"]  # a run snapshotted before these keys existed
    (tmp_path / CONFIG_SNAPSHOT).write_text(json.dumps(old))
    # A complete checkpoint to resume (without one, a rerun starts fresh: tests/test_run_safety.py).
    (tmp_path / "checkpoint_manager_snapshot.json").write_text(
        json.dumps({"checkpoint_results": [{"metrics": {"step": 2}}]}))
    check_resume(config, tmp_path)  # same math: resumes
    for override, key in (("model.lora.r=8", "model.lora.r: 0 -> 8"), ("train.lr=0.5", "train.lr")):
        changed = load_config("configs/tiny-cpu.yaml", ["train.steps=4", override])
        with pytest.raises(ConfigError, match=f"would change its math: {key}"):
            check_resume(changed, tmp_path)
        check_resume(load_config("configs/tiny-cpu.yaml", ["train.steps=4", override,
                                                           "train.allow_config_change=true"]), tmp_path)


def test_a_run_from_before_shuffling_and_templates_resumes_only_as_it_trained(tmp_path: Path) -> None:
    """Snapshots hold tuples as JSON lists; a run older than data.shuffle read in stream order, and its
    bool data.chat_template meant ChatML (true) or plain text (false)."""
    config = load_config("configs/tiny-cpu.yaml", ["train.steps=4", "data.data_files=[a.jsonl]"])
    (tmp_path / "checkpoint_manager_snapshot.json").write_text(
        json.dumps({"checkpoint_results": [{"metrics": {"step": 2}}]}))
    (tmp_path / CONFIG_SNAPSHOT).write_text(json.dumps(config.to_dict()))
    check_resume(config, tmp_path)  # ("a.jsonl",) vs ["a.jsonl"]: the same
    old = config.to_dict()
    del old["data"]["shuffle"]
    old["data"]["chat_template"] = True
    (tmp_path / CONFIG_SNAPSHOT).write_text(json.dumps(old))
    changed = r"data.shuffle: False -> True.*data.chat_template: 'chatml' -> 'auto'"  # in the tree's order
    with pytest.raises(ConfigError, match=changed):
        check_resume(config, tmp_path)
    check_resume(load_config("configs/tiny-cpu.yaml", ["train.steps=4", "data.data_files=[a.jsonl]",
                                                       "data.chat_template=chatml", "data.shuffle=false"]),
                 tmp_path)
