"""The planner's online-calibration state: recent plans, their measured laps, the newest fit.

    remember(step, plan)      the planner, as it publishes each step
    observe(laps, cost)       world rank 0's laps of a log window -> refit over the newest `window` steps
                              (scheduling/refit.py) -> the profile to plan with, or None (too little yet)
    explore(step)             skrull's candidate index over the first `window` steps of a start without a
                              fit (scheduling/skrull.py), else None
    adopt(record)             a checkpoint's fit, for a planner that has none

`record` is the newest fit as plain data (Refit.to_dict plus its `version`, counting fits): it rides on
every payload, the driver writes its profile to the run directory and the checkpoints keep it. Methods are
called from the planner actor's threads (the planning thread, workers' calls): one lock guards the state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from scheduling.cost import CostModel, HardwareProfile
from scheduling.refit import PlannedStep, StepTiming, refit


class Calibration:
    def __init__(self, window: int) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._fitting = threading.Lock()  # one fit at a time: each starts from the newest laps
        self._planned: dict[int, PlannedStep] = {}
        self._timings: dict[int, StepTiming] = {}
        self._explore: tuple[int, int] | None = None
        self.record: dict[str, Any] | None = None
        self.profile: HardwareProfile | None = None

    def begin(self, *, explore: bool) -> None:
        """A (re)start of planning: earlier plans and laps no longer match the steps. Exploring covers the
        run's first `window` steps (1..window, by step number: a restart inside them plans the same
        candidates as the run before it did) while there is no fit."""
        with self._lock:
            self._planned.clear()
            self._timings.clear()
            self._explore = (1, 1 + self.window) if explore and self.record is None else None

    def explore(self, step: int) -> int | None:
        """Skrull's candidate for `step` while exploring (module docstring), else None."""
        with self._lock:
            if self._explore is None or not self._explore[0] <= step < self._explore[1]:
                return None
            return step - self._explore[0]

    def remember(self, step: int, planned: PlannedStep) -> None:
        with self._lock:
            self._planned[step] = planned
            for old in [s for s in self._planned if s <= step - 4 * self.window]:
                del self._planned[old]

    def observe(self, timings: Sequence[dict[str, Any]], cost: CostModel, *,
                world: int) -> HardwareProfile | None:
        """Add the laps and refit over the newest `window` steps, relative to `cost` (the anchor); the
        fitted profile, or None."""
        with self._fitting:
            return self._observe(timings, cost, world)

    def _observe(self, timings: Sequence[dict[str, Any]], cost: CostModel,
                 world: int) -> HardwareProfile | None:
        with self._lock:
            for t in timings:
                self._timings[int(t["step"])] = StepTiming(
                    step=int(t["step"]), micro_batch_s=tuple(float(x) for x in t["micro_batch_s"]),
                    optimizer_s=float(t["optimizer_s"]), first_of_session=bool(t["first_of_session"]))
            newest = sorted(s for s in self._timings if s in self._planned)[-self.window:]
            for old in [s for s in self._timings if s not in newest]:
                del self._timings[old]
            planned = {s: self._planned[s] for s in newest}
            window = [self._timings[s] for s in newest]
        fit = refit(cost, planned, window, world=world)
        if fit is None:
            return None
        with self._lock:
            version = (self.record or {}).get("version", 0) + 1
            self.record = fit.to_dict() | {"version": version}
            self.profile = fit.profile
        return fit.profile

    def adopt(self, record: dict[str, Any]) -> bool:
        """Take a checkpoint's fit when there is none yet; True when taken."""
        with self._lock:
            if self.record is not None:
                return False
            self.profile = HardwareProfile.from_dict(record["profile"])
            self.record = dict(record)
            self._explore = None
            return True
