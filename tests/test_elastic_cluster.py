"""Elastic training on a real multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`).

A head node (driver, Ray Data, planner) and worker nodes that each declare one `train_slot`, so each holds
exactly one train worker. With `parallel.num_workers: [1, 2]`, removing a worker node mid-run must continue
on the other from the newest checkpoint, re-planned for DP=1; adding a node to a DP=1 run must grow the
group to DP=2 (Ray Train's resize monitor), re-planned from its newest checkpoint; samples.jsonl must stay
exact throughout, on a file of chats visited in a new seeded order each epoch (data.shuffle). Shrinking
and growing are one run each: one run doing both took ~90 s on 2 cores, the slowest test of the suite,
and each scenario needs only its own restart.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from app.config import load_config  # noqa: E402
from app.train.driver import TrainSummary, train  # noqa: E402
from tests.run_configs import SMALL_VOCAB, shuffled_chats, shuffled_step_ids  # noqa: E402

# 15 steps of 8 = three whole epochs of 40: the run outlasts a node change at step 2-3 by a dozen steps.
NUM_SAMPLES, BATCH, STEPS = 40, 8, 15
SLOT = {"train_slot": 1}


@pytest.fixture(scope="module")
def cluster(suite_ray) -> Iterator[object]:
    from ray.cluster_utils import Cluster

    suite_ray.stop()  # this process joins the cluster instead
    previous = os.environ.pop("RAY_ADDRESS", None)
    # Right after a node loss Ray Train's view of free resources can still count the lost node, so it
    # first tries the old size and waits this long for its placement group (default 60 s) before taking
    # the size that fits (seen in every node-loss logged here). The timeout covers only that wait: a
    # placement group on free resources is ready at once (0.00 s in every start logged here), so 2 s is
    # ample, and one that ran out would only be retried (a controller error has no retry limit).
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "2"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
    for _ in range(2):
        cluster.add_node(num_cpus=0, resources=SLOT)
    ray.init(address=cluster.address, log_to_driver=False)
    os.environ["RAY_ADDRESS"] = cluster.address  # the driver joins it as a cluster, not an embedded Ray
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.pop("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", None)
    if previous is not None:
        os.environ["RAY_ADDRESS"] = previous


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The resized runs' data: NUM_SAMPLES short chats in a parquet file, shuffled (tests/run_configs.py)."""
    return shuffled_chats(tmp_path_factory.mktemp("chats"), NUM_SAMPLES)


def _steps(run_dir: Path) -> dict[int, list[dict]]:
    """samples.jsonl lines by step (empty while it does not exist or is being rewritten)."""
    by_step: dict[int, list[dict]] = {}
    try:
        for line in (run_dir / "samples.jsonl").read_text().splitlines():
            record = json.loads(line)
            by_step.setdefault(record["step"], []).append(record)
    except (OSError, ValueError):
        return {}
    return by_step


def _wait_for(condition, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _group_starts(run_dir: Path) -> int:
    """Starts of the worker group the driver has recorded (worker_starts.jsonl, app/rundir/files.py)."""
    try:
        return len((run_dir / "worker_starts.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _refresh_ray_trains_view(slots: int) -> None:
    """Once Ray's node table shows `slots` live train slots, make Ray's AutoscalingCoordinator re-read it.

    Ray Train's elastic policy sizes the worker group from that actor's view of the cluster, which it
    refreshes every 20 s (TICK_INTERVAL_S, not configurable): a node change waited up to 20 s for Ray Train
    to see it. This runs the same refresh (its `_tick`) at once, as its next tick would.
    """
    def live() -> int:
        return sum(1 for node in ray.nodes() if node["Alive"] and node["Resources"].get("train_slot"))

    _wait_for(lambda: live() == slots, f"{slots} live nodes with a train slot", 60)
    coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    ray.get(coordinator.__ray_call__.remote(lambda actor: actor._tick()))


@contextmanager
def _hold_the_planner(run_name: str) -> Iterator[None]:
    """SIGSTOP the run's planner actor, SIGCONT on exit: each worker asks it for every step's plan (one
    blocking actor call), so the group in training waits at its next step, as behind a slow planner, and
    cannot finish the run before Ray Train's resize monitor has acted. Ray Train's controller never calls
    the planner, so its decisions are unaffected; the grown group's restart call waits until the exit."""
    (name,) = [n for n in ray.util.list_named_actors() if n.startswith(f"skrull-planner-{run_name}-")]
    pid = ray.get(ray.get_actor(name).__ray_call__.remote(lambda actor: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _dp_of_last_step(run_dir: Path) -> int:
    by_step = _steps(run_dir)
    return len(by_step[max(by_step)]) if by_step else 0


def _train_slots(cluster, slots: int) -> None:
    """Add or remove worker nodes until `slots` train slots are live and free (Ray Train told at once)."""
    while len(cluster.worker_nodes) > slots:
        cluster.remove_node(cluster.worker_nodes.copy().pop())
    while len(cluster.worker_nodes) < slots:
        cluster.add_node(num_cpus=0, resources=SLOT)
    cluster.wait_for_nodes()
    _wait_for(lambda: ray.available_resources().get("train_slot", 0) == slots, f"{slots} free slots", 60)
    try:  # Ray Train creates its coordinator with the module's first run
        ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    except ValueError:
        return
    _refresh_ray_trains_view(slots)


class _Run(threading.Thread):
    """`train(config)` in a thread, so that the test can change the cluster while it trains."""

    def __init__(self, config) -> None:
        super().__init__(daemon=True)
        self.config, self.summary, self.error = config, None, None

    def run(self) -> None:
        try:
            self.summary = train(self.config, progress=False)
        except BaseException as err:  # noqa: BLE001 - re-raised by finish()
            self.error = err

    def finish(self) -> TrainSummary:
        self.join(timeout=600)
        assert self.error is None and self.summary is not None, self.error
        return self.summary


def _elastic_run(tmp_path: Path, name: str, chats: list[str]) -> _Run:
    config = load_config("configs/tiny-cpu.yaml", [
        f"run.storage_path={tmp_path}", f"run.name={name}", *chats,
        f"scheduling.global_batch_size={BATCH}", SMALL_VOCAB, f"train.steps={STEPS}",
        "parallel.cp_size=1", "parallel.num_workers=[1, 2]", "parallel.resize_check_s=1",
        "resources.cpus_per_worker=0", "resources.worker_resources={train_slot: 1}",
        "train.checkpoint_every=1", "train.max_failures=4", "train.collective_timeout_s=15",
    ])
    run = _Run(config)
    run.start()
    return run


def _assert_resized_and_exact(summary: TrainSummary, run_dir: Path, *, first_dp: int, last_dp: int) -> None:
    """The run started at first_dp, restarted, trained its last steps at last_dp, every sample exact."""
    sizes = [h["world_size"] for h in summary.history]  # one per step (cp_size 1: world size = DP)
    assert sizes[0] == first_dp and sizes[-1] == last_dp, sizes
    assert summary.restarts >= 1 and summary.steps == STEPS
    by_step = _steps(run_dir)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    by_epoch: dict[int, list[int]] = {}
    for step, records in by_step.items():
        assert len(records) == len({r["dp_rank"] for r in records})  # one line per DP rank of that step
        # data.shuffle: each step the next batch of its epoch's seeded order, across every resize
        assert {i for r in records for i in r["sample_ids"]} == shuffled_step_ids(step, NUM_SAMPLES, BATCH)
        for record in records:
            by_epoch.setdefault(record["epoch"], []).extend(record["sample_ids"])
    for ids in by_epoch.values():  # 15 steps x 8 = 3 whole epochs of 40: each id once per epoch
        assert sorted(ids) == list(range(NUM_SAMPLES))


def test_losing_a_node_shrinks_the_worker_group_to_dp1(cluster, chats, tmp_path: Path) -> None:
    _train_slots(cluster, 2)
    run_dir = tmp_path / "shrink"
    run = _elastic_run(tmp_path, "shrink", chats)
    _wait_for(lambda: max(_steps(run_dir), default=0) >= 3 and _dp_of_last_step(run_dir) == 2, "DP=2 steps")
    with _hold_the_planner("shrink"):  # a step takes tens of milliseconds: the run must outlast the loss
        cluster.remove_node(cluster.worker_nodes.copy().pop())  # a worker node (and its train worker) is gone
        _refresh_ray_trains_view(slots=1)
        _wait_for(lambda: _group_starts(run_dir) >= 2, "the worker group shrunk to DP=1")
    _assert_resized_and_exact(run.finish(), run_dir, first_dp=2, last_dp=1)


def test_regaining_a_node_grows_the_worker_group_to_dp2(cluster, chats, tmp_path: Path) -> None:
    _train_slots(cluster, 1)
    run_dir = tmp_path / "grow"
    run = _elastic_run(tmp_path, "grow", chats)
    _wait_for(lambda: max(_steps(run_dir), default=0) >= 2, "DP=1 steps")
    with _hold_the_planner("grow"):
        cluster.add_node(num_cpus=0, resources=SLOT)
        _refresh_ray_trains_view(slots=2)
        _wait_for(lambda: _group_starts(run_dir) >= 2, "the worker group grown to DP=2")
    _assert_resized_and_exact(run.finish(), run_dir, first_dp=1, last_dp=2)


def test_a_worker_count_that_is_not_a_multiple_of_cp_trains_with_a_spare(cluster, tmp_path: Path) -> None:
    """Three train slots, cp_size 2, num_workers [2, 4]: Ray Train offers 3; DP 1 x CP 2 trains, one spare."""
    _train_slots(cluster, 3)
    config = load_config("configs/tiny-cpu.yaml", [
        f"run.storage_path={tmp_path}", "run.name=spare", f"data.num_samples={NUM_SAMPLES}",
        "data.length_scale=0.1", f"scheduling.global_batch_size={BATCH}", SMALL_VOCAB, "train.steps=5",
        "parallel.cp_size=2", "parallel.num_workers=[2, 4]", "resources.cpus_per_worker=0",
        "resources.worker_resources={train_slot: 1}", "parallel.resize_check_s=1",
    ])
    summary = train(config, progress=False)
    # Ray Train starts with what it sees free (3; or 2 if the third slot shows up late, then grows to 3).
    assert (3, 1, 1) in {(h["world_size"], h["dp_size"], h["spare_workers"]) for h in summary.history}
    assert summary.loss_last < summary.loss_first - 0.5, summary.losses
    by_step = _steps(tmp_path / "spare")
    assert sorted(by_step) == list(range(1, 6)) and all(len(r) == 1 for r in by_step.values())  # DP 1
    ids = [i for records in by_step.values() for r in records for i in r["sample_ids"]]
    assert sorted(ids) == list(range(NUM_SAMPLES))  # 5 steps x 8 = one epoch, each id once
