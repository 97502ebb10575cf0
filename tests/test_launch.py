"""run_workers (workers/tools/launch.py): ranks in one gloo group, forked from a preloaded server on a
host without CUDA, each seeing the caller's environment and working directory as they are at the call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.tools.launch import start_method


def _what_a_rank_sees(rank: int, world_size: int, name: str) -> tuple:
    import sys

    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return rank, world_size, os.environ.get(name), os.getcwd(), float(total), "deepspeed" in sys.modules


def test_ranks_see_the_callers_environment_and_directory_at_the_call(monkeypatch, tmp_path: Path) -> None:
    from workers.tools.launch import run_workers

    run_workers(_what_a_rank_sees, world_size=1, args=("SKRULL_LAUNCH_PROBE",), backend="gloo")
    # The fork server runs now: these changes come after it started.
    monkeypatch.setenv("SKRULL_LAUNCH_PROBE", "now")
    monkeypatch.chdir(tmp_path)
    results = run_workers(_what_a_rank_sees, world_size=3, args=("SKRULL_LAUNCH_PROBE",), backend="gloo")
    assert [r[:5] for r in results] == [(r, 3, "now", str(tmp_path), 6.0) for r in range(3)]
    if start_method("gloo") == "forkserver":
        assert all(r[5] for r in results)  # forked with DeepSpeed (and the rest of the preload) imported


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_cuda_ranks_and_gpu_hosts_spawn(backend: str, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert start_method(backend) == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert start_method(backend) == ("forkserver" if backend == "gloo" else "spawn")
