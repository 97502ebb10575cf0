"""One `train` driver process with its own embedded Ray, watched from outside: while it trains, every
socket any process of it listens on is a loopback one (gcs, raylet, object manager, core workers, agents,
dashboard, metrics exporters, torch.distributed's store and gloo); SIGTERM after its first step stops it
like Ctrl-C (exit 143, the `interrupted` line, the command that resumes it).

The Ctrl-C case, with the printed command run to the end, is tests/test_resilience.py's; this run only
trains until its first step (DP 1 x CP 2, 16 sequences of ~30 tokens).
"""

from __future__ import annotations

import ipaddress
import shlex
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.driver_process import Stopped, start_driver, stop_driver
from tests.run_configs import SMALL_VOCAB

pytestmark = pytest.mark.slow  # a driver process with its own Ray and a training run

psutil = pytest.importorskip("psutil")



@dataclass
class Watched:
    stopped: Stopped
    listening: dict[tuple[str, int], str] = field(default_factory=dict)
    """(address, port) -> the command line of the process listening there, over the whole run."""


class ListenSampler(threading.Thread):
    """Collects the LISTEN sockets of a process and all its descendants every `period_s`."""

    def __init__(self, root: int, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.root, self.period_s, self.stop = root, period_s, threading.Event()
        self.found: dict[tuple[str, int], str] = {}

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


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _trained_a_step(storage: Path) -> bool:
    return any(path.stat().st_size for path in storage.glob("*/samples.jsonl"))


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Watched:
    storage = tmp_path_factory.mktemp("embedded")
    driver = start_driver([f"run.storage_path={storage}", "run.name=sigterm", "data.num_samples=32",
                           "data.length_scale=0.1", "scheduling.global_batch_size=8", "train.steps=40",
                           SMALL_VOCAB])
    sampler = ListenSampler(driver.pid)
    sampler.start()
    deadline = time.monotonic() + 300
    while not _trained_a_step(storage):
        if driver.poll() is not None or time.monotonic() > deadline:
            sampler.stop.set()
            driver.kill()
            pytest.fail(f"the driver trained no step: {driver.communicate()[1].decode()[-3000:]}")
        time.sleep(0.2)
    # The workers' store and gloo sockets have been up since their group started (sampled every 0.25 s);
    # one more sample while they train.
    sampler.sample()
    sampler.stop.set()
    sampler.join()
    stopped = stop_driver(driver, signal.SIGTERM, timeout_s=90, grace_s=15)
    return Watched(stopped=stopped, listening=sampler.found)


def test_sigterm_stops_the_driver_like_ctrl_c(watched: Watched) -> None:
    stopped = watched.stopped
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert stopped.stopped_in_s < 60
    assert "interrupted (SIGTERM): Ray is shut down;" in stopped.stderr
    resume = shlex.split(stopped.stderr.split("Resume with:")[1].strip().splitlines()[0])
    assert resume[:4] == ["python", "-m", "app", "train"] and "run.name=sigterm" in resume
    assert not stopped.left_alive, stopped.left_alive


def test_every_socket_an_embedded_run_listens_on_is_loopback(watched: Watched) -> None:
    exposed = {f"{ip}:{port}": name for (ip, port), name in watched.listening.items() if not _is_loopback(ip)}
    assert not exposed, exposed
    names = list(watched.listening.values())
    # The run was watched while it trained: Ray's servers and the train workers (store, gloo) were up.
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), names
    assert any(n.startswith("ray::RayTrainWorker") for n in names), names
