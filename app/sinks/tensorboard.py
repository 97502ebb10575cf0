"""Every reported step's metrics as TensorBoard scalars under <run_dir>/tensorboard/ (always on).

The driver's progress bar receives each step's metrics (world rank 0's, app/train/progress.py) and hands them
here; `tensorboard --logdir runs` then shows every run's curves. Written with torch's SummaryWriter (the
event-file format tensorboard reads); nothing runs on the workers. Every numeric key of the record becomes a
tag (loss, mfu, padding_fraction, eval_loss when reported, ...); lists such as rank_compute_s are left to
metrics.jsonl (app/rundir/files.py). Added here, from the same record:

    tokens_per_s_per_worker = tokens_per_s / (dp_size * cp_size + spare_workers)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.sinks.base import RunStatus

TENSORBOARD_DIR = "tensorboard"
SKIPPED = frozenset({"step", "session", "warmup"})
"""Record keys that are not curves (the step is the x axis)."""


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The record's numeric values (booleans and identifiers left out) plus the derived per-worker rate."""
    values = {key: float(value) for key, value in metrics.items()
              if key not in SKIPPED and isinstance(value, int | float) and not isinstance(value, bool)}
    workers = int(metrics.get("dp_size", 0)) * int(metrics.get("cp_size", 0)) + int(
        metrics.get("spare_workers", 0))
    if workers and "tokens_per_s" in values:
        values["tokens_per_s_per_worker"] = values["tokens_per_s"] / workers
    return values


class TensorBoardLog:
    """Appends each step's scalars to the run's event files (a resumed run appends to the same folder)."""

    def __init__(self, run_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(run_dir) / TENSORBOARD_DIR
        self._writer = SummaryWriter(log_dir=str(self.directory))

    def write(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["step"])
        for tag, value in scalars(metrics).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self, status: RunStatus = RunStatus.FINISHED) -> None:
        self._writer.close()
