"""A `train` driver process with its own embedded Ray, started and stopped by a signal, as a user's shell
would (tests/test_resilience.py's Ctrl-C, tests/test_embedded_run.py's SIGTERM)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


def start_driver(overrides: list[str]) -> subprocess.Popen:
    """`python -m app train --config configs/tiny-cpu.yaml --no-progress --set ...`, its own embedded Ray
    (no RAY_ADDRESS), in a session of its own, its stdout and stderr piped."""
    command = [sys.executable, "-m", "app", "train", "--config", "configs/tiny-cpu.yaml", "--no-progress",
               *(part for o in overrides for part in ("--set", o))]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


@dataclass
class Stopped:
    returncode: int
    stderr: str
    stopped_in_s: float
    """Seconds from the signal to the driver's exit."""
    ray_processes: int
    """Processes the driver had started (its embedded Ray's) when it was signaled."""
    left_alive: list[str] = field(default_factory=list)
    """Those still alive `grace_s` after the driver exited (then killed)."""


def stop_driver(driver: subprocess.Popen, sig: int, *, timeout_s: float, grace_s: float) -> Stopped:
    """Send `sig` to the driver, wait up to timeout_s for it to exit, then up to grace_s for its Ray."""
    processes = psutil.Process(driver.pid).children(recursive=True)
    driver.send_signal(sig)
    sent = time.monotonic()
    _, stderr = driver.communicate(timeout=timeout_s)
    stopped_in_s = time.monotonic() - sent
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    left = []
    for process in alive:
        left.append(" ".join(process.cmdline()[:3]) if process.is_running() else str(process.pid))
        process.kill()
    return Stopped(returncode=driver.returncode, stderr=stderr.decode(), stopped_in_s=stopped_in_s,
                   ray_processes=len(processes), left_alive=left)
