"""A `train` driver process with its own embedded Ray, started and stopped by a signal, as a user's shell
would (tests/test_resilience.py's Ctrl-C, tests/test_embedded_run.py's SIGTERM).

Both drivers run at once (tests/conftest.py `signaled_drivers`), each on a SignaledDriver thread: one such
run alone leaves about a third of 2 cores idle (Ray's start-up and shutdown, the waits between its steps).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


PACED_STEPS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}
"""A signaled driver's controller polls its workers every 0.25 s, not the suite's 0.05 s (tests/conftest.py):
a worker reporting a step waits for the poll of its last report, so the steps of these runs come ~0.25 s
apart, and a signal sent once the controller has recorded a step's checkpoint lands with steps still to
train. At 0.05 s a step took tens of milliseconds, and a Ctrl-C run had trained all its 8 steps by the time
its signal, sent once step 2's checkpoint was recorded, landed (2026-11-26)."""


def start_driver(overrides: list[str]) -> subprocess.Popen:
    """`python -m app train --config configs/tiny-cpu.yaml --no-progress --set ...`, its own embedded Ray
    (no RAY_ADDRESS), in a session of its own, its stdout and stderr piped, its steps paced (PACED_STEPS)."""
    command = [sys.executable, "-m", "app", "train", "--config", "configs/tiny-cpu.yaml", "--no-progress",
               *(part for o in overrides for part in ("--set", o))]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | PACED_STEPS
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
    """Send `sig` to the driver, wait up to timeout_s for it to exit, then up to grace_s for its Ray.

    The driver's train workers are frozen (SIGSTOP) from before the signal until it is sent: a tiny run's
    steps take milliseconds, and a run that trained its last step first would end without the signal.
    """
    processes = psutil.Process(driver.pid).children(recursive=True)
    workers = [p for p in processes if _is_train_worker(p)]
    for worker in workers:
        worker.suspend()
    try:
        driver.send_signal(sig)
    finally:
        for worker in workers:
            worker.resume()
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


def _is_train_worker(process: psutil.Process) -> bool:
    try:
        return (process.cmdline() or [""])[0].startswith("ray::RayTrainWorker")
    except psutil.Error:  # gone already
        return False


class ListenSampler(threading.Thread):
    """Collects the LISTEN sockets of a process and all its descendants every `period_s`."""

    def __init__(self, root: int, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.root, self.period_s, self.stop = root, period_s, threading.Event()
        self.found: dict[tuple[str, int], str] = {}
        """(address, port) -> the command line of the process listening there."""

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.period_s)

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root)
            processes = {p.pid: p for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            return
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.pid in processes:
                try:
                    name = " ".join(processes[conn.pid].cmdline())[:100]
                except psutil.Error:
                    name = f"pid {conn.pid}"
                self.found.setdefault((conn.laddr.ip, conn.laddr.port), name)


class SignaledDriver(threading.Thread):
    """start_driver(overrides), then `sig` once `ready()` holds; `result()` is what stop_driver saw.

    With `sample_listening`, the LISTEN sockets of the driver and its descendants are sampled from its start
    to the signal (`listening`), once more right before the signal.
    """

    def __init__(self, overrides: list[str], ready: Callable[[], bool], sig: int, *, timeout_s: float,
                 grace_s: float, sample_listening: bool = False, limit_s: float = 300) -> None:
        super().__init__(daemon=True)
        self.overrides, self.ready, self.sig = overrides, ready, sig
        self.timeout_s, self.grace_s, self.limit_s = timeout_s, grace_s, limit_s
        self.sample_listening = sample_listening
        self.listening: dict[tuple[str, int], str] = {}
        self._stopped: Stopped | None = None
        self._failure = ""

    def run(self) -> None:
        driver = start_driver(self.overrides)
        sampler = ListenSampler(driver.pid) if self.sample_listening else None
        if sampler is not None:
            sampler.start()
        deadline = time.monotonic() + self.limit_s
        try:
            while not self.ready():
                if driver.poll() is not None or time.monotonic() > deadline:
                    driver.kill()
                    self._failure = f"the driver never got ready: {driver.communicate()[1].decode()[-3000:]}"
                    return
                time.sleep(0.2)
        finally:
            if sampler is not None:
                sampler.sample()
                sampler.stop.set()
                sampler.join()
                self.listening = sampler.found
        try:
            self._stopped = stop_driver(driver, self.sig, timeout_s=self.timeout_s, grace_s=self.grace_s)
        except Exception as err:  # noqa: BLE001 - reported by result()
            driver.kill()
            self._failure = f"stopping the driver: {err!r}"

    def result(self) -> Stopped:
        """Wait for the signaled driver to exit; an AssertionError if it never got ready or never exited."""
        self.join(self.limit_s + self.timeout_s + self.grace_s + 60)
        assert self._stopped is not None, self._failure or "the driver thread did not finish"
        return self._stopped
