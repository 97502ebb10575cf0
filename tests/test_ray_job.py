"""A real `ray start --head` on loopback, then `ray job submit` of the tiny config, as a user would.

The fixture starts Ray in its own process group and temp dir, and stops only that group, never a Ray
that something else on the machine started. Both tests share one head (starting and stopping one
cost ~37 s here): the job runs on it, and the embedded run must ignore it.
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
from pathlib import Path

import pytest

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
        # `ray start --block` outlived 30 s of SIGTERM in each run measured (2026-11-25), so the SIGKILL of
        # its group always came: 5 s of grace ends the same way, 25 s sooner.
        for sig, grace_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass


@pytest.mark.slow
def test_ray_job_submit_trains_the_tiny_config(ray_head: str, auth_env: dict[str, str],
                                                tmp_path: Path) -> None:
    entrypoint = [
        sys.executable, "-m", "app", "train", "--config", "configs/tiny-cpu.yaml", "--json",
        "--set", f"run.storage_path={tmp_path}", "--set", "run.name=job", "--set", "train.steps=3",
        "--set", "data.num_samples=24", "--set", "data.length_scale=0.1",
        "--set", "scheduling.global_batch_size=8", "--set", SMALL_VOCAB,
        "--set", "parallel.cp_size=1", "--set", "parallel.num_workers=1",  # what is tested: the job, not CP
    ]
    env = dict(os.environ, **auth_env)
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [str(RAY), "job", "submit", "--address", ray_head, "--working-dir", str(REPO), "--", *entrypoint],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"steps"')]
    assert summaries, result.stdout[-3000:]
    assert summaries[-1]["steps"] == 3 and summaries[-1]["samples"] == 24
    assert (tmp_path / "job" / "samples.jsonl").exists()


@pytest.mark.slow
def test_embedded_train_beside_a_running_cluster_is_quiet(ray_head: str, tmp_path: Path) -> None:
    """No RAY_ADDRESS while a `ray start` cluster runs: the run starts its own Ray and never touches that one;
    the terminal shows the data summary, the progress bar and the summary, the run's log holds the rest."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "app", "train", "--config", "configs/tiny-cpu.yaml",
               "--set", f"run.storage_path={tmp_path}", "--set", "run.name=quiet", "--set", "train.steps=2",
               "--set", "data.num_samples=32", "--set", "data.length_scale=0.1", "--set", SMALL_VOCAB,
               "--set", "parallel.cp_size=1", "--set", "parallel.num_workers=1"]  # its output, not CP
    # Bytes, not text=True: universal newlines would turn tqdm's \r redraws into lines of their own.
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, timeout=600)
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    log = (tmp_path / "quiet" / "logs" / "driver.log").read_text()
    assert result.returncode == 0, stderr[-3000:] + log[-3000:]
    # tqdm redraws its line with \r, so a terminal shows one line per \n.
    lines = [line for line in (stdout + stderr).split("\n") if line.strip()]
    assert len(lines) <= 8, lines
    assert stderr.startswith("data: ") and "trained 2 steps" in stdout
    assert "Reporting training result" in log and "Started a local Ray instance" in log
    assert "multiple active Ray instances" not in log and "Traceback" not in log
