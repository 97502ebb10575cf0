"""Live progress from the workers to the driver's progress bar.

Ray Train calls `ProgressCallback.after_report` in its controller once every worker has reported; the
callback forwards world rank 0's per-step metrics (the report's "history": every step since the last
report) to a tiny `RunMonitor` actor (app/train/run_monitor.py) that the driver polls. Nothing here is on the
workers' hot path.

The driver's progress thread hands every new record to its sinks (the run's metrics.jsonl, TensorBoard,
MLflow) and every new start of the worker group to its start sinks (worker_starts.jsonl), so a run's
directory tells its story while it runs (app/rundir/files.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TextIO

import ray
from ray.train import UserCallback


class ProgressCallback(UserCallback):
    def __init__(self, monitor: Any) -> None:
        self._monitor = monitor

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if metrics and metrics[0]:
            self._monitor.record.remote([dict(step) for step in metrics[0].get("history", ())])


class ProgressBar:
    """A tqdm bar on the driver fed by polling the monitor in a background thread."""

    def __init__(self, monitor: Any, total_steps: int, *, enabled: bool = True, file: TextIO | None = None,
                 poll_s: float = 0.5, sinks: tuple[Callable[[dict[str, Any]], None], ...] = (),
                 start_sinks: tuple[Callable[[dict[str, Any]], None], ...] = (),
                 line_sinks: tuple[Callable[[dict[str, Any]], str | None], ...] = ()) -> None:
        from tqdm import tqdm

        self._monitor = monitor
        self._sinks = sinks  # each new record also goes to these (metrics.jsonl, TensorBoard, MLflow)
        self._start_sinks = start_sinks  # each new start of the worker group goes to these
        self._line_sinks = line_sinks  # each new record goes to these; a line they return is printed
        self.starts: list[dict[str, Any]] = []
        self._bar = tqdm(total=total_steps, desc="train", unit="step", disable=not enabled, file=file)
        self._file = file  # tqdm.write prints to stdout unless told: `--json` keeps stdout for the summary
        self._poll_s = poll_s
        self.history: list[dict[str, Any]] = []
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ProgressBar:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            if self._error is None:
                self._drain()
        finally:
            self._bar.close()
        if self._error is not None and exc[0] is None:
            raise self._error

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self._drain()
            except Exception as err:  # noqa: BLE001 - a sink failed (a full disk): raised when fit ends,
                self._error = err     # as one error (app/train/failures.py), not a thread's traceback now
                return

    def _drain(self) -> None:
        new, starts = ray.get(self._monitor.poll.remote(len(self.history), len(self.starts)))
        for start in starts:  # a start comes before its group's first record
            self.starts.append(start)
            for sink in self._start_sinks:
                sink(start)
        for metrics in new:
            previous = self.history[-1] if self.history else None
            self.history.append(metrics)
            for sink in self._sinks:
                sink(metrics)
            if previous is not None and metrics.get("session") != previous.get("session"):
                self._bar.write(restart_line(previous, metrics))
            if metrics.get("update_skipped") and not metrics.get("stopped"):
                self._bar.write(skipped_line(metrics), file=self._file)
            for line_sink in self._line_sinks:
                line = line_sink(metrics)
                if line:
                    self._bar.write(line, file=self._file)
            self._bar.n = int(metrics["step"])  # a restarted group re-trains steps after its checkpoint
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")


def skipped_line(metrics: dict[str, Any]) -> str:
    """One line for the terminal when a step's update was dropped (train.nonfinite=skip)."""
    what = metrics.get("nonfinite", "loss or gradient norm")
    return (f"warning: step {metrics['step']}: non-finite {what}, "
            f"its update was skipped ({metrics.get('skipped_steps', '?')} skipped so far; "
            "train.max_skipped_steps in a row stop the run)")


def _shape(metrics: dict[str, Any]) -> str:
    spares = int(metrics.get("spare_workers", 0))
    return f"DP {metrics['dp_size']} x CP {metrics['cp_size']}" + (f" (+{spares} spare)" if spares else "")


def restart_line(previous: dict[str, Any], metrics: dict[str, Any]) -> str:
    """One line for the terminal when the worker group restarted (a failure or an elastic resize)."""
    before, after = _shape(previous), _shape(metrics)
    change = f"resized {before} -> {after}" if before != after else f"restarted ({after})"
    return (f"worker group {change} at step {previous['step']}: resumed from the checkpoint of step "
            f"{metrics['resumed_from_step']}")
