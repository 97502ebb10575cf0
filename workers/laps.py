"""Lap times of a step's parts (each micro-batch, then the optimizer step) without a host sync.

On CPU a lap is the wall time between two marks. On CUDA each mark records an event on the current stream
(no wait); the laps are the events' elapsed times, read when `seconds()` is called, which the metrics
window does on log steps only (workers/metrics.py), after the step's own end-of-step synchronize has
completed every event. The online calibration (scheduling/refit.py) fits the profile to these laps.
"""

from __future__ import annotations

import time

import torch


class Laps:
    """Marks taken at the start and after each part; `seconds()` gives one lap per part. A part may also
    mark where its own work begins (`begin`), so that `busy()` leaves out the idle time before it."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[float | torch.cuda.Event] = []
        self._begins: dict[int, float | torch.cuda.Event] = {}
        self.mark()

    def _now(self) -> float | torch.cuda.Event:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        """End the current part (start the next)."""
        self._marks.append(self._now())

    def begin(self) -> None:
        """The current part's own work starts now (what came since the last mark was waiting)."""
        self._begins[len(self._marks) - 1] = self._now()

    def _seconds(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3 if self._cuda else end - start

    def busy(self) -> list[float]:
        """Each part's seconds from its `begin` (else from the previous mark) to its end."""
        marks = self._marks
        return [self._seconds(self._begins.get(i, marks[i]), marks[i + 1]) for i in range(len(marks) - 1)]

    def total(self) -> float:
        """Seconds from the first mark to the last (CUDA: the events must have completed)."""
        first, last = self._marks[0], self._marks[-1]
        if self._cuda:
            return first.elapsed_time(last) / 1e3
        return last - first

    def seconds(self) -> list[float]:
        """Each part's seconds, in order (CUDA: the events must have completed)."""
        marks = self._marks
        if self._cuda:
            return [start.elapsed_time(end) / 1e3 for start, end in zip(marks, marks[1:], strict=False)]
        return [end - start for start, end in zip(marks, marks[1:], strict=False)]
