"""scripts/gpu_check.sh on a machine without CUDA: every stage fails at once, saying so (not `pytest -m cuda`
skipping everything and exiting 0); the stages' python (given, or the active python3) with its packages
from PYTHONPATH; the train stage's whole command line, run on CPU with the CUDA checks skipped
(SKRULL_GPU_CHECK_FAKE_CUDA) and a tiny model; scripts/torch_cuda.sh: the CUDA torch setup.sh installs for
a driver. The host's own GPUs do not matter: the tests hide nvidia-smi, replace it with one that fails,
lists a GPU or prints a driver's header, and give the stages a Python that sees no CUDA device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from app.config import REPO_ROOT

STAGES = ("install", "kernels", "verify", "train", "profile", "bench", "all")


def _environ(**env: str) -> dict[str, str]:
    """This process's environment without the script's own knobs (a developer's PYTHON, a leftover
    SKRULL_GPU_CHECK_*), plus `env`."""
    kept = {k: v for k, v in os.environ.items() if k != "PYTHON" and not k.startswith("SKRULL_GPU_CHECK")}
    return kept | env


def _gpu_check(tmp_path: Path, *args: str, path: str, **env: str) -> subprocess.CompletedProcess:
    env = _environ(PATH=path, OUT=str(tmp_path / "out"), **env)
    # 30 s: the bound for failing without CUDA (a guard against a stage that starts working anyway).
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=30)


def _path_without_nvidia_smi() -> str:
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not (Path(d) / "nvidia-smi").exists())


def _fake_nvidia_smi(tmp_path: Path, script: str) -> str:
    """A PATH whose nvidia-smi is `script`, ahead of the host's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    return os.pathsep.join([str(bin_dir), _path_without_nvidia_smi()])


@pytest.mark.parametrize("stage", STAGES)
def test_without_an_nvidia_driver_every_stage_fails_at_once(tmp_path: Path, stage: str) -> None:
    result = _gpu_check(tmp_path, stage, sys.executable, path=_path_without_nvidia_smi())
    assert result.returncode == 1, result.stdout + result.stderr
    assert "CUDA is not available: no nvidia-smi" in result.stderr
    assert not (tmp_path / "out" / "install.log").exists()  # `all` stops before installing anything


def test_a_failing_driver_is_named(tmp_path: Path) -> None:
    path = _fake_nvidia_smi(tmp_path, "echo \"NVIDIA-SMI has failed because it couldn't communicate with the "
                                      "NVIDIA driver\"; exit 9")
    result = _gpu_check(tmp_path, "all", path=path)
    assert result.returncode == 1
    assert "CUDA is not available: nvidia-smi fails (NVIDIA-SMI has failed" in result.stderr


def test_a_python_without_cuda_is_named_with_its_torch(tmp_path: Path) -> None:
    """The driver answers, but the stage's Python sees no CUDA device (a CPU torch, or none visible)."""
    path = _fake_nvidia_smi(tmp_path, GPU_LIST)
    python = tmp_path / "bin" / "python-without-cuda"
    python.write_text(f"#!/bin/sh\nCUDA_VISIBLE_DEVICES= exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    result = _gpu_check(tmp_path, "kernels", str(python), path=path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"CUDA is not available to {python} (torch " in result.stderr
    assert "run `bash scripts/gpu_check.sh install` first" in result.stderr
    assert not (tmp_path / "out" / "kernels.xml").exists()  # pytest never ran


def test_an_unknown_stage_is_a_usage_error(tmp_path: Path) -> None:
    result = _gpu_check(tmp_path, "everything", path=os.environ.get("PATH", ""))
    assert result.returncode == 2 and "usage: bash scripts/gpu_check.sh install|kernels" in result.stderr
    assert "|train|" in result.stderr


GPU_LIST = "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'"
SHIM = "0.0+shim"


@pytest.mark.parametrize("missing", ["driver", "device"])
def test_train_without_cuda_fails_at_once(tmp_path: Path, missing: str) -> None:
    """`bash scripts/gpu_check.sh train` (no python given) on a machine without a driver, and with a driver
    but a torch that sees no device: exit 1 within _gpu_check's 30 s, saying why, before any run."""
    if missing == "driver":
        result = _gpu_check(tmp_path, "train", path=_path_without_nvidia_smi())
        assert "gpu_check train: CUDA is not available: no nvidia-smi" in result.stderr
    else:
        _isolated_python(tmp_path / "bin" / "python3")  # the active python3, its torch a CUDA-less one
        result = _gpu_check(tmp_path, "train", path=_fake_nvidia_smi(tmp_path, GPU_LIST),
                            PYTHONPATH=str(_target_dir(tmp_path, "torch", "ray", "deepspeed")))
        assert f"gpu_check train: CUDA is not available to python3 (torch {SHIM} CUDA None)" in result.stderr
    assert result.returncode == 1, result.stdout + result.stderr
    assert not (tmp_path / "out" / "runs").exists()


def _target_dir(tmp_path: Path, *packages: str) -> Path:
    """A `pip install --target` stand-in: torch (CUDA-less), ray and deepspeed that import in milliseconds."""
    target = tmp_path / "target"
    version = f"__version__ = {SHIM!r}\n"
    modules = {"torch/__init__.py": version + "from torch import cuda, version\n",
               "torch/cuda.py": "def is_available():\n    return False\n",
               "torch/version.py": "cuda = None\n",
               "ray/__init__.py": version, "deepspeed/__init__.py": version}
    for name, text in modules.items():
        if name.split("/")[0] in packages:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_text(text)
    return target


def _isolated_python(path: Path) -> Path:
    """An interpreter that sees no site-packages (-S): whatever it imports beyond the standard library comes
    from PYTHONPATH."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("chosen_by", ["PYTHON", "python3"])
def test_all_skips_install_for_a_python_with_the_stack_on_pythonpath(tmp_path: Path, chosen_by: str) -> None:
    """PYTHON=..., or else the active python3, with torch, ray and deepspeed in a target directory on
    PYTHONPATH: `all` skips install and the next stage runs with that python (and names its torch)."""
    path = _fake_nvidia_smi(tmp_path, GPU_LIST)
    python = _isolated_python(tmp_path / "bin" / "python3")  # first on PATH: the active python3
    env = {"PYTHONPATH": str(_target_dir(tmp_path, "torch", "ray", "deepspeed"))}
    if chosen_by == "PYTHON":
        python = _isolated_python(tmp_path / "elsewhere" / "python")
        env["PYTHON"] = str(python)
    name = str(python) if chosen_by == "PYTHON" else "python3"
    result = _gpu_check(tmp_path, "all", path=path, **env)
    assert f"gpu_check install: skipped: {name} imports torch {SHIM} CUDA None ray {SHIM} deepspeed {SHIM}" \
        in result.stdout, result.stdout + result.stderr
    assert not (tmp_path / "out" / "install.log").exists()
    # kernels ran next, with that python: the shim torch sees no CUDA device
    assert result.returncode == 1
    assert f"gpu_check kernels: CUDA is not available to {name} (torch {SHIM} CUDA None)" in result.stderr


def test_all_refuses_a_given_python_without_the_stack_before_installing(tmp_path: Path) -> None:
    """install fills ./.venv, which a given python would not use: `all` says what that python lacks."""
    python = _isolated_python(tmp_path / "elsewhere" / "python")
    result = _gpu_check(tmp_path, "all", path=_fake_nvidia_smi(tmp_path, GPU_LIST), PYTHON=str(python),
                        PYTHONPATH=str(_target_dir(tmp_path, "torch")))
    assert result.returncode == 1, result.stdout + result.stderr
    assert (f"gpu_check all: {python} cannot import torch, ray and deepspeed (ModuleNotFoundError: No module "
            "named 'ray')") in result.stderr
    assert not (tmp_path / "out" / "install.log").exists()


TINY_TRAIN = ("model.dtype=fp32 model.hidden_size=64 model.num_layers=2 model.num_attention_heads=4 "
              "model.num_key_value_heads=2 model.kv_hidden_size=32 model.intermediate_size=128 "
              "model.vocab_size=1024 model.num_params=0 "
              "data.tokenizer=configs/bench/synth-bpe-773.json data.num_samples=16 data.length_scale=0.1 "
              "scheduling.global_batch_size=8 scheduling.bucket_size=1024 train.steps=2 "
              "resources.gpus_per_worker=0 resources.cpus_per_worker=0.5 resources.data_cpus=0.5")
"""CPU-sized overrides of the train stage's GPU run: a 2-layer model, 2 steps of 8 short chats."""


@pytest.mark.slow  # a `train` driver with its own embedded Ray
def test_the_train_stage_runs_its_command_line_on_cpu(tmp_path: Path) -> None:
    """gpu_check.sh train as on a GPU (its config, overrides, run directory, train.json), with the CUDA
    checks skipped and TINY_TRAIN appended; the python is the venv's base interpreter with the venv's
    packages on PYTHONPATH (a target directory), so the driver and Ray's workers import them from there."""
    from app.config import load_config
    from app.profiling.memory import memory_terms

    base = getattr(sys, "_base_executable", sys.executable)
    site = sysconfig.get_paths()["purelib"]
    env = _environ(OUT=str(tmp_path / "out"), PYTHON=base, PYTHONPATH=site, SKRULL_GPU_CHECK_FAKE_CUDA="1",
                   SKRULL_GPU_CHECK_TRAIN_SET=TINY_TRAIN)
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "train"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The GPU run's own command line ran, the overrides after it
    command = next(line for line in result.stdout.splitlines() if line.startswith("== "))
    assert command.startswith(f"== env -u RAY_ADDRESS {base} -m app train --config "
                              "configs/qwen2.5-0.5b-gpu.yaml")
    assert "--set model.hidden_size=896" in command
    assert command.endswith("--set resources.data_cpus=0.5 --json")
    out = tmp_path / "out"
    report = json.loads((out / "train.json").read_text())
    run_dir = out / "runs" / "train"
    assert report["run_dir"] == str(run_dir) and report["status"] == "finished" and report["steps"] == 2
    for key in ("tokens", "tokens_per_s", "tokens_per_s_median", "mfu_median", "step_s_median",
                "predicted_step_s_median", "profile_ratio"):
        assert report[key] > 0, key
    assert report["profile"] == "h100" and report["gpu"] is None
    assert report["gpu_peak_bytes"] is None and report["gpu_peak_over_predicted"] is None  # CPU: no GPU peak
    # The memory model of the tiny shape (h=64, h_kv=2*16, I=128, L=2, V=1024, fp32, W=1): the terms of
    # scheduling.bucket_size=auto (app/profiling/memory.py, whose own test writes them out) at C = 1024
    params = (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) * 2 + 2 * 1024 * 64
    terms = memory_terms(load_config(run_dir / "skrull_config.json"))
    alpha = terms.activation_per_token
    assert report["memory_model"]["params"] == params
    assert report["memory_model"]["activation_bytes_per_token"] == alpha
    assert report["predicted_peak_bytes"] == pytest.approx(terms.peak_bytes)
    assert terms.peak_bytes == pytest.approx(terms.static + terms.runtime + terms.loss + alpha * 1024)
    assert report["python"] == base and report["torch_from"] == site
    config = json.loads((run_dir / "skrull_config.json").read_text())
    assert config["model"]["attention_backend"] == "auto" and config["model"]["random_init"] is True
    assert config["data"]["source"] == "synthetic" and config["data"]["distribution"] == "lmsys"
    assert config["parallel"]["num_workers"] == 1 and config["parallel"]["cp_size"] == 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) >= 1 and not any("gpu_peak_bytes" in r for r in records)
    # Where the wall time went: the steps, the first step's start-up (its record only), the rest
    time = report["time"]
    assert time["engine_s"] == records[0]["engine_s"] > 0 and time["warmup_s"] == records[0]["warmup_s"] > 0
    assert not any("engine_s" in r for r in records[1:])
    assert time["steps_s"] == pytest.approx(sum(r["step_s"] for r in records))
    assert time["other_s"] > 0 and time["wall_s"] == pytest.approx(
        time["steps_s"] + time["engine_s"] + time["warmup_s"] + time["other_s"])
    # ... and its finer split: the driver's phases (within wall_s), the engine build's, the last checkpoint
    summary = json.loads((out / "train_run.json").read_text())
    phases = time["phases_s"]
    assert phases == summary["phases_s"] and {"preflight", "ray_start", "data", "workers"} <= set(phases)
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= time["wall_s"] + 0.05
    assert time["engine_phases_s"] == records[0]["engine_phases_s"]
    assert sum(time["engine_phases_s"].values()) == pytest.approx(time["engine_s"], abs=1e-6)
    assert time["checkpoint_s"] == records[-1]["checkpoint_s"] > 0
    assert time["workers_other_s"] > 0 and time["workers_other_s"] == pytest.approx(
        phases["workers"] - time["steps_s"] - time["engine_s"] - time["warmup_s"] - time["checkpoint_s"])
    assert "  wall time   " in result.stdout and "final checkpoint " in result.stdout
    assert "              driver: preflight " in result.stdout
    assert "              engine: import " in result.stdout
    assert "train: 2 steps (finished)" in result.stdout
    assert f"train.json: {out / 'train.json'}" in result.stdout


def _torch_cuda(*args: str, path: str | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "SKRULL_TORCH_INDEX"}
    environ.update(PATH=path or _path_without_nvidia_smi(), **env)
    return subprocess.run(["bash", "scripts/torch_cuda.sh", *args], cwd=REPO_ROOT, env=environ,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(("cuda", "pip_args"), [
    ("13.0", ["torch==2.13.0"]),  # the package index's own 2.13.0 wheel is a CUDA 13.0 build
    ("13.2", ["torch==2.13.0"]),
    ("12.9", ["torch==2.13.0+cu128", "--extra-index-url", "https://download.pytorch.org/whl/cu128"]),
    ("12.8", ["torch==2.13.0+cu128", "--extra-index-url", "https://download.pytorch.org/whl/cu128"]),
    ("12.6", ["torch==2.13.0+cu126", "--extra-index-url", "https://download.pytorch.org/whl/cu126"]),
])
def test_setup_picks_the_cuda_torch_the_driver_runs(tmp_path: Path, cuda: str, pip_args: list[str]) -> None:
    result = _torch_cuda(cuda)
    assert result.returncode == 0 and result.stdout.splitlines() == pip_args, result.stderr


def test_an_old_driver_or_none_is_named_and_an_index_overrides(tmp_path: Path) -> None:
    old = _torch_cuda("12.4")
    assert old.returncode == 1 and "supports CUDA 12.4, older than any torch 2.13.0 build" in old.stderr
    header = "| NVIDIA-SMI 570.86.15     Driver Version: 570.86.15     CUDA Version: 12.8     |"
    read = _torch_cuda(path=_fake_nvidia_smi(tmp_path, f"echo '{header}'"))
    assert read.stdout.splitlines()[0] == "torch==2.13.0+cu128"  # nvidia-smi's header, read
    none = _torch_cuda()
    assert none.returncode == 1 and "no CUDA version from nvidia-smi" in none.stderr
    chosen = _torch_cuda("12.4", SKRULL_TORCH_INDEX="https://example.invalid/whl/cu124")
    assert chosen.stdout.splitlines() == ["torch==2.13.0", "--index-url", "https://example.invalid/whl/cu124"]


TINY_SPEED = ("model.dtype=fp32 model.hidden_size=64 model.num_layers=2 model.num_attention_heads=4 "
              "model.num_key_value_heads=2 model.kv_hidden_size=32 model.intermediate_size=128 "
              "model.vocab_size=1024 model.num_params=0 data.tokenizer=configs/bench/synth-bpe-773.json "
              "data.length_scale=0.05 scheduling.global_batch_size=8 scheduling.bucket_size=1024")
"""CPU-sized overrides of the speed stage's bench step (the 0.5B shape's --set list comes first)."""


def test_the_speed_stage_runs_its_bench_step_matrix_on_cpu(tmp_path: Path) -> None:
    """gpu_check.sh speed with the CUDA checks skipped: its `bench step` part (the 0.5B command line with
    TINY_SPEED after it, two of the matrix's variants, one counted step) runs, and speed.json holds its
    JSON and the part's status. The other parts (train: the test above; profile, peer, the CUDA tests)
    are commands of their own, tested where they live."""
    env = _environ(OUT=str(tmp_path / "out"), PYTHON=sys.executable, SKRULL_GPU_CHECK_FAKE_CUDA="1",
                   SKRULL_GPU_CHECK_SPEED_PARTS="step", SKRULL_GPU_CHECK_SPEED_STEPS="1",
                   SKRULL_GPU_CHECK_SPEED_SET=TINY_SPEED,
                   SKRULL_GPU_CHECK_SPEED_VARIANTS=(
                       "today:train.optimizer_impl=foreach,train.overlap_comm=on,model.kernels=torch "
                       "device_step:train.optimizer_impl=fused,train.overlap_comm=auto"))
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "speed"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    command = next(line for line in result.stdout.splitlines() if line.startswith("== "))
    assert " -m app bench step --config configs/qwen2.5-0.5b-gpu.yaml " in command
    assert command.endswith("--max-seconds 195 --json")  # inside the part's 240 s time box
    assert "--set model.hidden_size=896" in command and "--set scheduling.bucket_size=16384" in command
    speed = json.loads((tmp_path / "out" / "speed.json").read_text())
    assert speed["parts"]["step"]["exit"] == 0 and set(speed["parts"]) == {"step"}
    assert speed["parts"]["step"]["limit_s"] == 240 and speed["budget_s"] == 360 and speed["complete"]
    step = speed["bench_step"]
    assert set(step["variants"]) == {"today", "device_step"}
    assert step["variants"]["device_step"]["optimizer"] == "fused AdamW, device step"
    assert step["variants"]["today"]["optimizer"] == "foreach AdamW, DeepSpeed step"
    assert step["speedup_vs_first"]["today"] == 1.0 and step["stopped_early"] is None
    losses = [step["variants"][name]["losses"] for name in ("today", "device_step")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)  # the same global batches, the same math


def test_the_speed_stage_keeps_to_its_budget_and_says_what_it_skipped(tmp_path: Path) -> None:
    """SKRULL_GPU_CHECK_SPEED_BUDGET_S bounds the whole stage: a part with under 20 s of it left is skipped
    (its command never starts), speed.json says so, and the stage exits 1: not complete."""
    env = _environ(OUT=str(tmp_path / "out"), PYTHON=sys.executable, SKRULL_GPU_CHECK_FAKE_CUDA="1",
                   SKRULL_GPU_CHECK_SPEED_PARTS="profile,step", SKRULL_GPU_CHECK_SPEED_BUDGET_S="15")
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "speed"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gpu_check speed: profile skipped: " in result.stdout and "== " not in result.stdout
    speed = json.loads((tmp_path / "out" / "speed.json").read_text())
    assert speed["budget_s"] == 15 and not speed["complete"]
    statuses = {name: p["status"] for name, p in speed["parts"].items()}
    assert statuses == {"profile": "skipped", "step": "skipped"}
    assert "not complete: profile (skipped), step (skipped)" in result.stdout


def test_the_speed_stage_runs_its_parts_in_the_order_given_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    """SKRULL_GPU_CHECK_SPEED_PARTS is also the order (a short budget skips each part, in that order, without
    starting its command); a name that is no part exits 2 naming the knob before any part is tried."""
    env = _environ(OUT=str(tmp_path / "out"), PYTHON=sys.executable, SKRULL_GPU_CHECK_FAKE_CUDA="1",
                   SKRULL_GPU_CHECK_SPEED_PARTS="train,step,profile", SKRULL_GPU_CHECK_SPEED_BUDGET_S="15")
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "speed"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    parts = (tmp_path / "out" / "speed_parts.txt").read_text().split()[::4]
    assert parts == ["train", "step", "profile"]
    env.update(OUT=str(tmp_path / "out2"), SKRULL_GPU_CHECK_SPEED_PARTS="profile,matrix")
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "speed"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "SKRULL_GPU_CHECK_SPEED_PARTS: unknown part 'matrix'" in result.stderr
    assert not (tmp_path / "out2" / "speed_parts.txt").exists()
