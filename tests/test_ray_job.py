"""A real `ray start --head` on loopback, then `ray job submit` of the tiny config, as a user would.

The fixture starts Ray in its own process group and temp dir, and stops only that group, never a Ray
that something else on the machine started. Both tests share one head (starting and stopping one
cost ~37 s here): the job runs on it, and the embedded run, started just before the job and training at
the same time, must ignore it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.doc_commands import doc_argv
from tests.run_configs import SMALL_VOCAB
from workers.tools.launch import free_port

REPO = Path(__file__).resolve().parent.parent
RAY = Path(sys.executable).with_name("ray")


def _wait_for_dashboard(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the Ray dashboard at {url} did not come up in {timeout_s} s")


NO_AGENT = "No available agent to submit job"
"""The head's answer while its node's job agent is still starting (the dashboard answers before it): nothing
was submitted, so submitting again is safe. Seen on a loaded 2-core machine (load average ~12)."""


def _submit(command: list[str], env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`ray job submit`, again every 2 s while the head says its job agent is not up yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        if NO_AGENT not in result.stdout + result.stderr or time.monotonic() > deadline:
            return result
        time.sleep(2)


def _auth_env() -> dict[str, str]:
    """Ray >= 2.5x guards the jobs API with a token; one made here, given to the head and the client."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture(scope="module")
def auth_env() -> dict[str, str]:
    return _auth_env()


@pytest.fixture(scope="module")
def ray_head(auth_env: dict[str, str], suite_ray) -> Iterator[str]:
    suite_ray.stop()  # nothing here uses it: its idle daemons would only take CPU from the head's run
    dashboard = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **auth_env)
    env.pop("RAY_ADDRESS", None)
    command = [str(RAY), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               f"--port={free_port()}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
               f"--ray-client-server-port={free_port()}", "--num-cpus=4", f"--temp-dir={temp_dir}",
               "--disable-usage-stats"]
    proc = subprocess.Popen(command, env=env, cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_dashboard(url, proc)
        yield url
    finally:
        # SIGKILL to its process group at once: `ray start --block` outlived 30 s of SIGTERM in each run
        # measured (2026-11-25), so a SIGTERM first only waited for the SIGKILL that always came.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


@dataclass
class QuietRun:
    driver: subprocess.Popen
    storage: Path
    stdout: Path
    stderr: Path


@pytest.fixture(scope="module")
def quiet_run(ray_head: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuietRun]:
    """`python -m app train` without RAY_ADDRESS while the `ray start` cluster runs, started here and waited
    for by its test: the job test below takes this fixture so that the job trains at the same time (each run
    alone leaves about a third of 2 cores idle, in its start-up and between its steps)."""
    storage = tmp_path_factory.mktemp("quiet")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # The README's and the quickstart's main job, as documented (tests/doc_commands.py), shrunk by overrides.
    command = [sys.executable, "-m", "app", *doc_argv("train --config configs/tiny-cpu.yaml"),
               "--set", f"run.storage_path={storage}", "--set", "run.name=quiet", "--set", "train.steps=2",
               "--set", "data.num_samples=32", "--set", "data.length_scale=0.1", "--set", SMALL_VOCAB,
               "--set", "parallel.cp_size=1", "--set", "parallel.num_workers=1"]  # its output, not CP
    stdout, stderr = storage / "stdout", storage / "stderr"
    with stdout.open("wb") as out, stderr.open("wb") as err:  # files, not pipes: none is read while it runs
        driver = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=err)
    run = QuietRun(driver=driver, storage=storage, stdout=stdout, stderr=stderr)
    try:
        yield run
    finally:
        if run.driver.poll() is None:  # its test did not run or failed before it ended
            run.driver.kill()
            run.driver.wait()


@pytest.mark.slow
def test_ray_job_submit_trains_the_tiny_config(ray_head: str, auth_env: dict[str, str], quiet_run: QuietRun,
                                                tmp_path: Path) -> None:
    """The tiny config as a Ray job on the `ray start` head, while quiet_run's own run trains beside it."""
    entrypoint = [
        sys.executable, "-m", "app", "train", "--config", "configs/tiny-cpu.yaml", "--json",
        "--set", f"run.storage_path={tmp_path}", "--set", "run.name=job", "--set", "train.steps=3",
        "--set", "data.num_samples=24", "--set", "data.length_scale=0.1",
        "--set", "scheduling.global_batch_size=8", "--set", SMALL_VOCAB,
        "--set", "parallel.cp_size=1", "--set", "parallel.num_workers=1",  # what is tested: the job, not CP
    ]
    env = dict(os.environ, **auth_env)
    env.pop("RAY_ADDRESS", None)
    result = _submit([str(RAY), "job", "submit", "--address", ray_head, "--working-dir", str(REPO), "--",
                      *entrypoint], env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"steps"')]
    assert summaries, result.stdout[-3000:]
    assert summaries[-1]["steps"] == 3 and summaries[-1]["samples"] == 24
    assert (tmp_path / "job" / "samples.jsonl").exists()


@pytest.mark.slow
def test_embedded_train_beside_a_running_cluster_is_quiet(quiet_run: QuietRun) -> None:
    """No RAY_ADDRESS while a `ray start` cluster runs (and trains the job above): the run starts its own Ray
    and never touches that one; the terminal shows the data summary, the progress bar and the summary, the
    run's log holds the rest."""
    quiet_run.driver.wait(timeout=600)
    # Bytes, not text: universal newlines would turn tqdm's \r redraws into lines of their own.
    stdout, stderr = quiet_run.stdout.read_bytes().decode(), quiet_run.stderr.read_bytes().decode()
    log = (quiet_run.storage / "quiet" / "logs" / "driver.log").read_text()
    assert quiet_run.driver.returncode == 0, stderr[-3000:] + log[-3000:]
    # tqdm redraws its line with \r, so a terminal shows one line per \n.
    lines = [line for line in (stdout + stderr).split("\n") if line.strip()]
    assert len(lines) <= 8, lines
    assert stderr.startswith("data: ") and "trained 2 steps" in stdout
    assert "Reporting training result" in log and "Started a local Ray instance" in log
    assert "multiple active Ray instances" not in log and "Traceback" not in log
    assert log.count("[skrull] engine ready in ") == 1, log[-3000:]  # a worker's print reaches it once
