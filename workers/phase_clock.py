"""Wall seconds of consecutive phases, each ended by `lap(name)`: the engine build's (workers/engine.py)
and a `train` call's on the driver (app/train/driver.py). Torch-free: the caller passes how a phase waits
for its device, if it has one."""

from __future__ import annotations

import time
from collections.abc import Callable


class PhaseClock:
    """{phase: seconds} in the order the phases ended (time.monotonic); `wait` runs before each lap's
    reading (on CUDA a device synchronize, so a phase's queued work counts in it rather than in the next)."""

    def __init__(self, started: float | None = None, wait: Callable[[], None] | None = None) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.monotonic() if started is None else started
        self._wait = wait

    def lap(self, name: str) -> None:
        """End phase `name` now (a name given twice adds up)."""
        if self._wait is not None:
            self._wait()
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now
