"""The `RunMonitor` actor: the run's reported steps and worker-group starts, polled by the driver.

Its own module, importing nothing but Ray: an actor's process imports the module that defines its class,
and app/train/progress.py's Ray Train import (with Ray Data and pandas) cost ~3 s of CPU in every
run's monitor.
"""

from __future__ import annotations

from typing import Any

import ray


@ray.remote(num_cpus=0)
class RunMonitor:
    """Keeps every reported step's metrics (rank 0's), in order, and every start of the worker group."""

    def __init__(self) -> None:
        self._history: list[dict[str, Any]] = []
        self._starts: list[dict[str, Any]] = []

    def group_started(self, session: str, resumed_from_step: int) -> None:
        """World rank 0 of each start of the worker group, before training (a group may die before its
        first report, so restarts are counted here, not from the reports)."""
        self._starts.append({"session": session, "resumed_from_step": resumed_from_step})

    def starts(self) -> list[dict[str, Any]]:
        return list(self._starts)

    def record(self, steps: list[dict[str, Any]]) -> None:
        self._history.extend(steps)

    def since(self, index: int) -> list[dict[str, Any]]:
        return self._history[index:]

    def poll(self, index: int, start_index: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The records from `index` on and the group starts from `start_index` on, in one call."""
        return self._history[index:], self._starts[start_index:]
