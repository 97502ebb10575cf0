"""Is the hardware profile stale? Compare measured step times with the times it predicted for those plans.

Every step's payload carries the cost model's time of its plan (scheduling/payload.py predicted_step_s),
and every step's metrics its measured step_s (workers/metrics.py). Over the first N steps (N = 8, or the
run's length when shorter):

    ratio  = median over those steps of predicted_step_s / step_s
    stale  = |ratio - 1| > 30%

A stale profile plans with the wrong trade-off between FLOPs, the ring and the per-micro-batch cost, so
one warning names hardware.profile and the `profile` command that measures this machine again. `train`
checks while it runs (a ProgressBar line sink, app/train/progress.py), `bench train` on its counted steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STALE_STEPS = 8
"""Steps compared: enough for a median past the first step's warm-up, early enough to act on."""
STALE_TOLERANCE = 0.30


def stale_warning(ratio: float, profile: str, config: str) -> str:
    """The one warning line: how far off the profile is, and how to refresh it."""
    direction = "slower" if ratio > 1 else "faster"
    off = ratio - 1 if ratio > 1 else 1 / ratio - 1
    return (f"warning: hardware.profile={profile} predicts steps {off:.0%} {direction} than this machine "
            f"runs them (median of predicted / measured step time {ratio:.2f}); plans trade FLOPs, ring and "
            f"per-micro-batch costs by it: measure this machine with `python -m app profile --config "
            f"{config}` and set hardware.profile to the file it writes")


def median_ratio(pairs: Iterable[tuple[float, float]]) -> float | None:
    """Median of predicted / measured over the pairs where both are finite and positive; None if none."""
    ratios = sorted(p / m for p, m in pairs if _usable(p) and _usable(m))
    if not ratios:
        return None
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def _usable(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@dataclass
class StaleProfileCheck:
    """Fed each step's metrics in order; returns the warning once, when the first N steps are in."""

    profile: str
    config: str
    total_steps: int
    pairs: dict[int, tuple[float, float]] = field(default_factory=dict)
    done: bool = False

    @property
    def steps_needed(self) -> int:
        return max(1, min(STALE_STEPS, self.total_steps))

    def __call__(self, metrics: dict[str, Any]) -> str | None:
        if self.done or "predicted_step_s" not in metrics:
            return None
        # a restarted group re-trains steps after its checkpoint: the first measurement of a step counts
        self.pairs.setdefault(int(metrics["step"]), (metrics["predicted_step_s"], metrics["step_s"]))
        if len(self.pairs) < self.steps_needed:
            return None
        self.done = True
        ratio = median_ratio(self.pairs.values())
        if ratio is None or abs(ratio - 1) <= STALE_TOLERANCE:
            return None
        return stale_warning(ratio, self.profile, self.config)
