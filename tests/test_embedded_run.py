"""One `train` driver process with its own embedded Ray, watched from outside: while it trains, every
socket any process of it listens on is a loopback one (gcs, raylet, object manager, core workers, agents,
dashboard, metrics exporters, torch.distributed's store and gloo); SIGTERM after its first step stops it
like Ctrl-C (exit 143, the `interrupted` line, the command that resumes it).

The Ctrl-C case, with the printed command run to the end, is tests/test_resilience.py's; this run only
trains until its first step (DP 1 x CP 2, 16 sequences of ~30 tokens), at the same time as that one
(tests/conftest.py `signaled_drivers`).
"""

from __future__ import annotations

import ipaddress
import shlex
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.driver_process import SignaledDriver, Stopped
from tests.run_configs import SMALL_VOCAB

pytestmark = pytest.mark.slow  # a driver process with its own Ray and a training run



@dataclass
class Watched:
    stopped: Stopped
    listening: dict[tuple[str, int], str] = field(default_factory=dict)
    """(address, port) -> the command line of the process listening there, over the whole run."""


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def sigterm_driver(storage: Path) -> SignaledDriver:
    """The driver of this module, SIGTERMed after its first step; the LISTEN sockets of every process of it
    sampled every 0.25 s from its start (the workers' store and gloo sockets are up from their group's start
    on), and once more while it trains."""
    def trained_a_step() -> bool:
        return any(path.stat().st_size for path in storage.glob("*/samples.jsonl"))

    return SignaledDriver([f"run.storage_path={storage}", "run.name=sigterm", "data.num_samples=32",
                           "data.length_scale=0.1", "scheduling.global_batch_size=8", "train.steps=40",
                           SMALL_VOCAB], trained_a_step, signal.SIGTERM, timeout_s=90, grace_s=15,
                          sample_listening=True)


@pytest.fixture(scope="module")
def watched(signaled_drivers: dict[str, SignaledDriver]) -> Watched:
    driver = signaled_drivers["sigterm"]
    return Watched(stopped=driver.result(), listening=driver.listening)


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
