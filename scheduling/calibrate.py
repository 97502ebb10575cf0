"""Fit the compute half of a hardware profile from measured micro-batch times.

The cost model charges one micro-batch of forward FLOPs F (summed `CostModel.flops` of its sequences)

    T(F) = F * train_flops_factor / (peak_flops * mfu) + micro_batch_launch_s

so measured (F_i, t_i) pairs of forward+backward passes on one device (no gradient reduction) fit a line
t = slope * F + intercept by least squares, and

    mfu                  = train_flops_factor / (slope * peak_flops)
    micro_batch_launch_s = intercept (clipped at 0: a negative intercept is noise around zero)

The fitted mfu is *effective*: it is relative to the cost model's FLOP formula, which leaves out the
embedding, the LM head and the loss, so it folds their time in, which is what the planner needs. The fit
quality (largest relative residual) says whether T is linear in F on that device, which is the cost
model's central assumption (the paper's a*F + b).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduling.cost import HardwareProfile


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeFit:
    slope_s_per_flop: float
    intercept_s: float
    mfu: float
    micro_batch_launch_s: float
    max_rel_residual: float
    """max_i |fit(F_i) - t_i| / t_i."""

    def predict(self, flops: float) -> float:
        return self.slope_s_per_flop * flops + self.intercept_s


def fit_compute(flops: Sequence[float], seconds: Sequence[float], profile: HardwareProfile) -> ComputeFit:
    """Least-squares line through (forward FLOPs, seconds); see the module docstring for the mapping."""
    f = np.asarray(flops, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if f.shape != t.shape or f.size < 2 or np.ptp(f) <= 0:
        raise ValueError("fit_compute needs at least two measurements with different FLOPs")
    if np.any(t <= 0):
        raise ValueError("fit_compute needs positive times")
    slope, intercept = np.polyfit(f, t, 1)
    if slope <= 0:
        raise ValueError("measured time does not grow with FLOPs: use a larger --max-tokens "
                         "(or more --repeats)")
    residual = np.abs(slope * f + intercept - t) / t
    return ComputeFit(
        slope_s_per_flop=float(slope), intercept_s=float(intercept),
        mfu=float(profile.train_flops_factor / (slope * profile.peak_flops)),
        micro_batch_launch_s=float(max(intercept, 0.0)), max_rel_residual=float(residual.max()),
    )
