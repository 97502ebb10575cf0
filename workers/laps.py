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
    """Marks taken at the start and after each part; `seconds()` gives one lap per part."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[float | torch.cuda.Event] = []
        self.mark()

    def mark(self) -> None:
        """End the current part (start the next)."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Each part's seconds, in order (CUDA: the events must have completed)."""
        marks = self._marks
        if self._cuda:
            return [start.elapsed_time(end) / 1e3 for start, end in zip(marks, marks[1:], strict=False)]
        return [end - start for start, end in zip(marks, marks[1:], strict=False)]
