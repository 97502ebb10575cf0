"""scripts/gpu_check.sh on a machine without CUDA: every stage fails at once, saying so (not `pytest -m cuda`
skipping everything and exiting 0); scripts/torch_cuda.sh: the CUDA torch setup.sh installs for a driver.
The host's own GPUs do not matter: the tests hide nvidia-smi, replace it with one that fails, lists a GPU
or prints a driver's header, and give the stages a Python that sees no CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import REPO_ROOT

STAGES = ("install", "kernels", "verify", "profile", "bench", "all")


def _gpu_check(tmp_path: Path, *args: str, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=path, OUT=str(tmp_path / "out"))
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
    path = _fake_nvidia_smi(tmp_path, "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'")
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
