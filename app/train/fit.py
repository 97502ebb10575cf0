"""`trainer.fit()` on the driver: under the progress bar, with the run's metric sinks open, interruptible.

    open_sinks (app/sinks/registry.py) ─▶ ProgressBar (polls the RunMonitor actor; hands every record to
        the sinks and the stale-profile check, every worker-group start to worker_starts.jsonl)
        ─▶ trainer.fit() on a helper thread, so that Ctrl-C stays the driver's
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from app.config import SkrullConfig
from app.rundir.files import CONFIG_SNAPSHOT

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.train import Result
    from ray.train.torch import TorchTrainer

    from app.profiling.calibration_log import CalibrationLog
    from app.profiling.stale_check import StaleProfileCheck


def fit_with_progress(config: SkrullConfig, trainer: TorchTrainer, monitor: ActorHandle, total_steps: int, *,
                      progress: bool, out: TextIO, run_dir: Path | None = None,
                      run_name: str | None = None) -> tuple[Result, list[dict[str, Any]]]:
    """trainer.fit() (Ctrl-C stays the driver's) under a progress bar fed by `monitor`; with `run_dir`,
    every record also goes to the run's metric sinks (app/sinks/registry.py) and each group start to
    worker_starts.jsonl, as the run `run_name` (default: run_dir's name). Without `run_dir` (bench train,
    which judges its counted steps itself: app/bench/summary.py) no sink and no stale-profile check.

    Returns (Ray Train's result, every reported record in order).
    """
    from app.sinks.registry import SinkContext, open_sinks
    from app.sinks.run_log import WorkerStartsLog
    from app.train.progress import ProgressBar

    # Ray Train hands both variables to its controller and workers from the driver's environment.
    # ray.train.report is a barrier of Ray Train's own (not torch's), without a timeout by default: a peer
    # hung between two collectives would hang it. Ray Train's print patch tees a worker's print to stdout
    # and to its logger's stderr, so every line a worker prints would reach the driver's log twice.
    environment = {"RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(config.train.collective_timeout_s),
                   "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    if run_dir is None:
        sinks: contextlib.AbstractContextManager[tuple[Any, ...]] = contextlib.nullcontext(())
        starts, checks = (), ()
    else:
        sinks = open_sinks(SinkContext(config=config, run_dir=run_dir, run_name=run_name or run_dir.name,
                                       total_steps=total_steps, out=out))
        starts = (WorkerStartsLog(run_dir, total_steps).write,)
        checks = (_profile_check(config, run_dir, total_steps),)
    with sinks as opened, ProgressBar(monitor, total_steps, enabled=progress, file=out,
                                      sinks=tuple(sink.write for sink in opened), start_sinks=starts,
                                      line_sinks=checks) as bar, _environment(environment):
        result = _fit_interruptibly(trainer)
    return result, bar.history


def _profile_check(config: SkrullConfig, run_dir: Path,
                   total_steps: int) -> CalibrationLog | StaleProfileCheck:
    """What the run says about its hardware profile: with online calibration the fits it made
    (app/profiling/calibration_log.py), else whether the profile is stale (app/profiling/stale_check.py;
    `profile` takes the run's saved config)."""
    if config.scheduling.calibration == "online":
        from app.profiling.calibration_log import CalibrationLog

        return CalibrationLog(profile=config.hardware.profile, run_dir=run_dir)
    from app.profiling.stale_check import StaleProfileCheck

    return StaleProfileCheck(profile=config.hardware.profile, config=str(run_dir / CONFIG_SNAPSHOT),
                             total_steps=total_steps)


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (a value the user exported wins), then restore."""
    added = {k: v for k, v in variables.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _fit_interruptibly(trainer: Any) -> Any:
    """trainer.fit() on a helper thread, so that Ctrl-C reaches the main thread as KeyboardInterrupt.

    Called on the main thread, Ray Train's fit installs its own SIGINT handler (a graceful abort after which
    fit raises an error and the process exits 1, and the handler stays installed); off the main thread it
    does not, and Ctrl-C stays the driver's: Ray is shut down (every process of an embedded one), the
    newest complete checkpoint stays as it is, and `train` prints the command that resumes the run.
    """
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            outcome["error"] = err

    thread = threading.Thread(target=fit, name="skrull-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)  # a timed join lets the main thread take KeyboardInterrupt
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
