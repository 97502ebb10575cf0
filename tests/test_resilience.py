"""Survive the cluster, on an embedded Ray (CPU, gloo): resume on another worker count, a killed worker, a
killed planner, Ctrl-C on the driver.

Every run trains the same 12 global batches (8 short chats from a file of 40, visited in a new
seeded order each epoch: data.shuffle; DP=2 x CP=1, random-init tiny Qwen2, fp32) as one uninterrupted
reference run, so each interrupted run must reproduce the reference's batches and losses: fp32 summation
order differs between DP sizes and restarts (~1e-7 relative per step), which Adam's normalized updates keep
far below the 1e-4 relative tolerance. Faults are injected from a thread that watches the run's
samples.jsonl (world rank 0 appends each step's line as soon as the step is trained).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Ray Train runs, one of them a driver process of its own

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from app.__main__ import main  # noqa: E402
from app.config import ConfigError, load_config  # noqa: E402
from app.profiling.calibration_log import FITTED_PROFILE  # noqa: E402
from app.profiling.hardware import load_hardware_profile  # noqa: E402
from app.rundir.snapshot import recorded_step  # noqa: E402
from app.train.driver import TrainSummary, train  # noqa: E402
from app.train.report import run_report  # noqa: E402
from tests.driver_process import SignaledDriver, Stopped  # noqa: E402
from tests.run_configs import NO_EXPORT, SMALL_VOCAB, scheduled_lrs, shuffled_chats, shuffled_step_ids  # noqa: E402

NUM_SAMPLES, BATCH, STEPS = 40, 8, 12
WARMUP, LR = 3, 0.003  # LR: configs/tiny-cpu.yaml's
"""Every run here warms its learning rate up over 3 steps, so a start after step 1 or 2 (a resume on
another worker count, a restart) that put the schedule anywhere but at its step shows in the next `lr`
(the shrunk run resumes at step 7, the grown one at 8). Only warmup: these runs change train.steps between
calls, which moves a decay's end (the Ctrl-C run, which does not, decays)."""
WARMUP_LRS = scheduled_lrs(LR, WARMUP, STEPS, kind="constant")
# Long enough for every legitimate wait in a collective of these runs (steps and checkpoints of
# milliseconds, ranks that start within a second or two of each other), short enough not to idle.
HUNG_TIMEOUT_S = 10
COMMON = [f"scheduling.global_batch_size={BATCH}", "parallel.cp_size=1", "parallel.num_workers=2",
          SMALL_VOCAB, f"train.warmup_steps={WARMUP}", NO_EXPORT,
          "train.lr=3e-3"]  # configs/tiny-cpu.yaml's, as written in the file too: YAML 1.2 floats train


def _overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [f"run.storage_path={tmp_path}", f"run.name={name}", *COMMON, f"train.steps={STEPS}", *extra]


def _lrs(summary: TrainSummary) -> list[float]:
    return [h["lr"] for h in summary.history]


def _config(tmp_path: Path, name: str, *extra: str):
    return load_config("configs/tiny-cpu.yaml", _overrides(tmp_path, name, *extra))


def _assert_samples_exact(run_dir: str | Path, steps: int) -> None:
    """samples.jsonl holds steps 1..steps once each, each step the batch of its epoch's shuffled order, and
    no sample id twice within an epoch."""
    lines = [json.loads(line) for line in Path(run_dir, "samples.jsonl").read_text().splitlines()]
    assert sorted({line["step"] for line in lines}) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        ids = {i for line in lines if line["step"] == step for i in line["sample_ids"]}
        assert ids == shuffled_step_ids(step, NUM_SAMPLES, BATCH), f"step {step}"
    by_epoch: dict[int, list[int]] = {}
    for line in lines:
        by_epoch.setdefault(line["epoch"], []).extend(line["sample_ids"])
    assert sum(len(ids) for ids in by_epoch.values()) == steps * BATCH
    assert sorted(by_epoch[0]) == list(range(NUM_SAMPLES))  # 12 x 8 = 96: epochs 0 and 1, 16 rows of 2
    for ids in by_epoch.values():
        assert len(ids) == len(set(ids))


def _trained_step(run_dir: Path) -> int:
    path = run_dir / "samples.jsonl"
    try:
        return max((json.loads(line)["step"] for line in path.read_text().splitlines()), default=0)
    except (OSError, ValueError):
        return 0  # not written yet, or caught mid-rewrite


def _group_starts(run_dir: Path) -> int:
    """Worker group starts the driver has recorded (worker_starts.jsonl, app/rundir/files.py)."""
    try:
        return len((run_dir / "worker_starts.jsonl").read_text().splitlines())
    except OSError:
        return 0


class FaultInjector(threading.Thread):
    """Runs each (step, action) once the run has trained that step, in order.

    After each action it waits for the next worker group's start, which the driver appends to
    worker_starts.jsonl (app/rundir/files.py), so that the next fault reaches the restarted group. A line the
    failed group wrote past its newest checkpoint could still trigger the next fault before the restarted
    group cuts it (workers/checkpoints.py cut_samples): the faults here are two steps apart, and a failed
    group records at most the step after its fault.
    """

    def __init__(self, run_dir: Path, faults: list[tuple[int, Callable[[], None]]]) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.faults, self.done, self.errors = run_dir, faults, [], []
        self.recovered_after_s: list[float] = []
        """Seconds from each fault to the next worker group's start."""

    def run(self) -> None:
        for step, action in self.faults:
            while _trained_step(self.run_dir) < step:
                time.sleep(0.05)  # a fault must land before the two steps after its step are trained
            starts = _group_starts(self.run_dir)
            try:
                action()
                self.done.append(step)
            except Exception as err:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(err))
                return
            self._wait_for_restart(starts, started=time.monotonic())

    def _wait_for_restart(self, starts: int, started: float, limit_s: float = 600) -> None:
        while _group_starts(self.run_dir) <= starts and time.monotonic() - started < limit_s:
            time.sleep(0.1)
        self.recovered_after_s.append(time.monotonic() - started)


def _train_worker_pids() -> list[int]:
    """Live Ray Train worker processes, found by their process title (`ray::RayTrainWorker...`): read
    from /proc at once, where Ray's state API may lag behind a group that was just torn down."""
    pids = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or [""]
        if cmdline[0].startswith("ray::RayTrainWorker") and process.status() != psutil.STATUS_ZOMBIE:
            pids.append(process.info["pid"])
    return pids


def _signal_a_worker(sig: int, earlier_groups: set[int]) -> Callable[[], None]:
    """Send `sig` to a train worker of the current group (never one of a group already signaled).

    Its peers are frozen (SIGSTOP) from before the signal until it is sent: a step here takes tens of
    milliseconds, and a group that trained the run's last steps in the meantime would end it unfaulted.
    """
    def send() -> None:
        pids = [pid for pid in _train_worker_pids() if pid not in earlier_groups]
        assert pids, "no RayTrainWorker process of the current group"
        earlier_groups.update(pids)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            os.kill(pids[-1], sig)
        finally:
            for pid in pids[:-1]:
                os.kill(pid, signal.SIGCONT)
    return send


def _kill_the_planner(run_name: str, signaled: set[int]) -> Callable[[], None]:
    """ray.kill the planner of run `run_name` (named skrull-planner-<run>-<hex>); Ray restarts it.

    The worker group it fails joins `signaled` (see _signal_a_worker), so that a later fault of the same
    run reaches the restarted group.

    The train workers are frozen (SIGSTOP) from before the lookup until the kill returns: a worker that
    fetched its last plan before the kill never notices it. On a busy 2-core CI machine the lookup through
    Ray's state API once took longer than the two steps left, and the run ended without a restart.
    """
    def kill() -> None:
        prefix = f"skrull-planner-{run_name}-"
        workers = _train_worker_pids()
        signaled.update(workers)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            (name,) = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
            ray.kill(ray.get_actor(name), no_restart=False)
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
    return kill


def _train_with_faults(tmp_path: Path, name: str, faults, *extra: str) -> tuple[TrainSummary, FaultInjector]:
    injector = FaultInjector(tmp_path / name, faults)
    injector.start()
    summary = train(_config(tmp_path, name, "train.checkpoint_every=1", *extra), progress=False)
    injector.join(timeout=5)
    assert injector.done == [step for step, _ in faults] and not injector.errors, injector.errors
    return summary, injector


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Every run's data: NUM_SAMPLES short chats in a parquet file, shuffled (tests/run_configs.py)."""
    return shuffled_chats(tmp_path_factory.mktemp("chats"), NUM_SAMPLES)


@pytest.fixture(scope="module")
def reference_run(local_ray, tmp_path_factory: pytest.TempPathFactory, chats: list[str]) -> TrainSummary:
    """The same 12 steps trained without interruption (metrics reduced every 4 steps, checkpoints every 2)."""
    config = _config(tmp_path_factory.mktemp("reference"), "reference", *chats, "train.log_every=4",
                     "train.checkpoint_every=2")
    return train(config, progress=False)


@pytest.fixture(scope="module")
def reference(reference_run: TrainSummary) -> list[float]:
    return reference_run.losses


def test_an_uninterrupted_run_reports_every_step_and_keeps_two_checkpoints(reference_run) -> None:
    summary = reference_run
    assert summary.resumed_from_step is None and summary.restarts == 0
    # Metrics reduced on every second step (checkpoints) and every fourth (log_every): every step reported
    # once.
    assert [h["step"] for h in summary.history] == list(range(1, STEPS + 1))
    assert summary.loss_last < summary.loss_first - 0.5, summary.losses
    assert [h["lr"] for h in summary.history] == pytest.approx(WARMUP_LRS, rel=1e-6)
    assert {h["world_size"] for h in summary.history} == {2}
    lines = Path(summary.run_dir, "samples.jsonl").read_text().splitlines()
    assert {json.loads(line)["dp_rank"] for line in lines} == {0, 1}
    _assert_samples_exact(summary.run_dir, STEPS)
    # train.keep_checkpoints defaults to 2: of the six saved, the newest two remain.
    assert len([p for p in Path(summary.run_dir).glob("checkpoint_*") if p.is_dir()]) == 2


@pytest.fixture(scope="module")
def shrunk(local_ray, tmp_path_factory: pytest.TempPathFactory,
           chats: list[str]) -> tuple[Path, TrainSummary, TrainSummary]:
    """Run "dp": 2 workers to step 6, then 1 worker to step 7 (ZeRO-2 state through a universal checkpoint).

    Shared by the two resume tests below: the second grows the same run back to 2 workers (one run of
    three calls split so that neither test holds all three). Six steps: enough for the planner's online
    calibration to fit the profile (scheduling.calibration=online) before the run is resized.
    """
    tmp_path = tmp_path_factory.mktemp("resume")
    first = train(_config(tmp_path, "dp", *chats, "train.steps=6"), progress=False)
    shrunk = train(_config(tmp_path, "dp", *chats, "train.steps=7", "parallel.num_workers=1"), progress=False)
    return tmp_path, first, shrunk


def _checkpointed_fit(run_dir: Path) -> dict:
    """The online fit the run's newest checkpoint holds (workers/checkpoints.py skrull_state.json)."""
    states = [json.loads(p.read_text()) for p in run_dir.glob("checkpoint_*/skrull_state.json")]
    newest = max(states, key=lambda state: state["step"])
    assert newest["calibration"] is not None, newest
    return newest["calibration"]


def test_resume_on_fewer_workers(shrunk, reference) -> None:
    """The resized run plans with the profile the run fitted before (its checkpoint's) from its first
    step."""
    tmp_path, first, shrunk = shrunk
    assert [h["world_size"] for h in first.history] == [2] * 6
    assert shrunk.resumed_from_step == 6 and [h["world_size"] for h in shrunk.history] == [1]
    assert first.losses + shrunk.losses == pytest.approx(reference[:7], rel=1e-4)
    assert _lrs(first) + _lrs(shrunk) == pytest.approx(WARMUP_LRS[:7], rel=1e-6)
    fitted = [h["calibration"] for h in first.history if "calibration" in h]
    assert fitted and fitted[-1]["version"] >= 1
    assert shrunk.history[0]["calibration"] == fitted[-1]  # adopted from the checkpoint of step 6
    profile = load_hardware_profile(str(tmp_path / "dp" / FITTED_PROFILE))  # the run directory's copy
    assert dataclasses.asdict(profile) == fitted[-1]["profile"]


def test_resume_on_more_workers_through_a_killed_planner_and_a_killed_worker(shrunk, reference,
                                                                            chats) -> None:
    """The shrunk run grown to 2 workers again to step 12, through two faults, then what a rerun refuses.

    - Its planner is killed after step 8: Ray restarts it from the driver's arguments, at this run's
      starting cursor of step 7; the restarted worker group must move it to step 8's.
    - A worker of the restarted group is SIGKILLed (by pid) after step 10: Ray Train restarts the group
      from the newest checkpoint (step 10's).
    - Each fault leaves steps to train: a worker fetches the plan of its next step ahead, so a planner
      kill before the last step alone goes unnoticed, and a worker killed after the last step kills
      nothing (the workers are frozen while a fault is injected, the fault seen within ~0.1 s).
    - Then a changed math key, and a finished run, are refused.
    (One run for both faults: each run costs ~28 s of Ray Train start-up on 2 cores, a fault ~15 s.)
    """
    tmp_path, first, shrunk = shrunk
    signaled: set[int] = set()
    resumed_fit = _checkpointed_fit(tmp_path / "dp")
    faults = [(8, _kill_the_planner("dp", signaled)), (10, _signal_a_worker(signal.SIGKILL, signaled))]
    grown, _ = _train_with_faults(tmp_path, "dp", faults, *chats, "train.max_failures=2")
    assert grown.resumed_from_step == 7 and grown.restarts == 2 and grown.steps == STEPS - 7
    assert [h["world_size"] for h in grown.history] == [2] * (STEPS - 7)
    # Every start plans with the run's newest fit: the resumed one from the checkpoint, the restarted
    # planner (Ray starts it without one) from the checkpoint its worker group restarts from.
    assert min(h["calibration_version"] for h in grown.history) >= resumed_fit["version"] >= 1
    assert first.losses + shrunk.losses + grown.losses == pytest.approx(reference, rel=1e-4)
    assert _lrs(first) + _lrs(shrunk) + _lrs(grown) == pytest.approx(WARMUP_LRS, rel=1e-6)
    _assert_samples_exact(grown.run_dir, STEPS)

    with pytest.raises(ConfigError, match=r"train.lr: 0.003 -> 0.001.*train.allow_config_change"):
        train(_config(tmp_path, "dp", *chats, f"train.steps={STEPS + 2}", "train.lr=0.001"), progress=False)
    with pytest.raises(ConfigError, match=rf"already trained {STEPS} steps \(train.steps={STEPS}\); raise "
                                          r"train.steps"):
        train(_config(tmp_path, "dp", *chats), progress=False)


def test_a_hung_peer_is_recovered_from_the_newest_checkpoint(reference, chats, tmp_path: Path) -> None:
    """SIGSTOP a train worker after step 2.

    The stopped peer's partners fail their next collective (the gradient reduce-scatter over ZeRO's
    group, or the metrics reduction) after train.collective_timeout_s; Ray Train then tears the group
    down (SIGKILL reaches a stopped process) and restarts it from the newest checkpoint.
    """
    faults = [(2, _signal_a_worker(signal.SIGSTOP, set()))]
    summary, injector = _train_with_faults(tmp_path, "hung", faults, *chats, "train.max_failures=1",
                                           f"train.collective_timeout_s={HUNG_TIMEOUT_S}")
    assert summary.restarts == 1 and summary.steps == STEPS
    assert summary.losses == pytest.approx(reference, rel=1e-4)
    assert _lrs(summary) == pytest.approx(WARMUP_LRS, rel=1e-6)
    _assert_samples_exact(summary.run_dir, STEPS)
    # The hung step failed within the timeout: the next group had started soon after it (the timeout,
    # then Ray Train's teardown and a new group's start: ~15-25 s on this machine).
    assert injector.recovered_after_s[-1] < HUNG_TIMEOUT_S + 90, injector.recovered_after_s


def test_a_zero3_run_equals_the_zero2_run_and_resumes_exactly_after_a_killed_worker(reference, chats,
                                                                                   tmp_path: Path) -> None:
    """The reference's first 6 steps at train.zero_stage=3 (the weights partitioned over both ranks,
    gathered per layer), one worker SIGKILLed after step 3: Ray Train restarts the group from step 3's
    ZeRO-3 checkpoint. The losses equal the ZeRO-2 reference's within 1e-5 relative (the same fp32 sums,
    reduced in another order), and the run exports as a ZeRO-2 run does (app/model/export.py); its own
    end-of-run export (train.export_on_finish) holds the same weights."""
    from app.model.export import export

    steps = 6
    faults = [(3, _signal_a_worker(signal.SIGKILL, set()))]
    summary, _ = _train_with_faults(tmp_path, "zero3", faults, *chats, f"train.steps={steps}",
                                    "train.max_failures=1", "train.zero_stage=3",
                                    "train.export_on_finish=true")
    assert summary.restarts == 1 and summary.resumed_from_step is None
    assert [h["step"] for h in summary.history] == list(range(1, steps + 1))
    assert summary.losses == pytest.approx(reference[:steps], rel=1e-5)
    assert _lrs(summary) == pytest.approx(WARMUP_LRS[:steps], rel=1e-6)
    _assert_samples_exact(summary.run_dir, steps)
    exported = export(summary.run_dir, str(tmp_path / "exported"))
    assert (exported.kind, exported.step) == ("model", steps)
    # the run's own end-of-run export, streamed from the restarted group's ZeRO-3 state: the same weights
    import torch
    from safetensors.torch import load_file

    own, cli = (load_file(str(Path(d, "model.safetensors"))) for d in (summary.export, exported.out))
    assert set(own) == set(cli) and all(torch.equal(own[k], cli[k]) for k in cli)


CTRL_C_DECAY = ("train.lr_scheduler=cosine", "train.min_lr_ratio=0.1")
"""The Ctrl-C run decays its rate after the warmup: its resume must continue the same curve."""


def ctrl_c_driver(tmp_path_factory: pytest.TempPathFactory) -> SignaledDriver:
    """This module's Ctrl-C run: a `train` driver process (its own embedded Ray) SIGINTed after step 2, on
    its own copy of the chats; started by tests/conftest.py `signaled_drivers`, beside
    tests/test_embedded_run.py's SIGTERM driver."""
    tmp_path = tmp_path_factory.mktemp("ctrl_c")
    chats = shuffled_chats(tmp_path_factory.mktemp("ctrl_c_chats"), NUM_SAMPLES)

    def trained_two_steps() -> bool:
        return any(recorded_step(d) >= 2 for d in tmp_path.glob("skrull-*"))

    return SignaledDriver(_overrides(tmp_path, "", *chats, "train.checkpoint_every=1", *CTRL_C_DECAY),
                          trained_two_steps, signal.SIGINT, timeout_s=60, grace_s=10)


@pytest.fixture(scope="module")
def interrupted(local_ray, signaled_drivers: dict[str, SignaledDriver]) -> Stopped:
    """What the Ctrl-C run's driver left behind. Its resume is the next test's (on the suite's Ray)."""
    return signaled_drivers["ctrl_c"].result()


def test_ctrl_c_stops_within_seconds_and_prints_the_command_that_resumes(interrupted: Stopped) -> None:
    assert interrupted.ray_processes, "the embedded Ray started no process"
    assert interrupted.stopped_in_s < 30 and interrupted.returncode == 130, interrupted.stderr[-3000:]
    assert not interrupted.left_alive, interrupted.left_alive
    resume = shlex.split(interrupted.stderr.split("Resume with:")[1].strip().splitlines()[0])
    assert resume[:4] == ["python", "-m", "app", "train"]


def test_the_command_printed_on_ctrl_c_resumes_the_run_to_its_end(interrupted: Stopped, capsys) -> None:
    """The printed command, run through the CLI's own entry point (app.__main__.main) in this process, on
    the suite's Ray: a second interpreter and Ray would only repeat ~15 s of start-up."""
    resume = shlex.split(interrupted.stderr.split("Resume with:")[1].strip().splitlines()[0])
    capsys.readouterr()
    assert main([*resume[3:], "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["resumed_from_step"] >= 2 and summary["steps"] == STEPS - summary["resumed_from_step"]
    _assert_samples_exact(summary["run_dir"], STEPS)
    # Both calls' steps, each once; a step checkpointed in the moment of Ctrl-C may have had no record yet.
    history = run_report(summary["run_dir"])["history"]
    steps, resumed = [h["step"] for h in history], summary["resumed_from_step"]
    assert steps[resumed - STEPS:] == list(range(resumed + 1, STEPS + 1))
    expected = scheduled_lrs(LR, WARMUP, STEPS, 0.1)
    assert [h["lr"] for h in history] == pytest.approx([expected[s - 1] for s in steps], rel=1e-6)


def test_a_restart_or_resize_is_one_line_with_both_shapes() -> None:
    from app.train.progress import restart_line

    before = {"step": 7, "dp_size": 2, "cp_size": 2, "spare_workers": 0, "resumed_from_step": 0}
    shrunk = {"step": 6, "dp_size": 1, "cp_size": 2, "spare_workers": 1, "resumed_from_step": 5}
    assert restart_line(before, shrunk) == ("worker group resized DP 2 x CP 2 -> DP 1 x CP 2 (+1 spare) at "
                                            "step 7: resumed from the checkpoint of step 5")
    again = dict(before, resumed_from_step=6)
    assert restart_line(before, again) == ("worker group restarted (DP 2 x CP 2) at step 7: resumed from the "
                                           "checkpoint of step 6")
