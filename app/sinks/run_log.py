"""The run directory's own records (formats: app/rundir/files.py), appended so that a resumed run continues
the same files:

    RunLog           a metric sink (app/sinks/base.py): every step record to metrics.jsonl
    WorkerStartsLog  every start of the worker group to worker_starts.jsonl (restarts are counted from it)
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

from app.rundir.files import METRICS_FILE, STARTS_FILE, append_jsonl
from app.sinks.base import RunStatus


class RunLog:
    """Step records to <run_dir>/metrics.jsonl."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)

    def write(self, metrics: dict[str, Any]) -> None:
        append_jsonl(self.run_dir / METRICS_FILE, metrics)

    def close(self, status: RunStatus) -> None:
        """Nothing to flush: every record was one whole appended line."""


class WorkerStartsLog:
    """Group starts of one `train` call to <run_dir>/worker_starts.jsonl, tagged with the call's id."""

    def __init__(self, run_dir: str | Path, total_steps: int) -> None:
        self.run_dir = Path(run_dir)
        self._total_steps = total_steps
        self._driver = secrets.token_hex(4)  # one id per `train` call: restarts are counted within it

    def write(self, start: dict[str, Any]) -> None:
        append_jsonl(self.run_dir / STARTS_FILE, {"driver": self._driver, **start,
                                                  "total_steps": self._total_steps, "time": time.time()})
