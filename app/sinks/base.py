"""The one interface of a metric sink, and the statuses a run ends with.

    sink.write(record)    every reported step's record (world rank 0's metrics), from the driver's progress
                          thread, in step order; a restarted worker group re-sends the steps it re-trains
    sink.close(status)    once, when the run's fit ends: FINISHED, FAILED (any error) or KILLED (Ctrl-C or
                          SIGTERM), whatever happened to the other sinks
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol


class RunStatus(StrEnum):
    """How a `train` call ended (MLflow's run statuses, which W&B maps to an exit code)."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"


class MetricSink(Protocol):
    def write(self, metrics: dict[str, Any]) -> None: ...

    def close(self, status: RunStatus) -> None: ...
