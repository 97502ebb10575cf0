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

The other halves of the profile are lines too, fitted by the same least squares (`fit_linear`):
activation memory peak_bytes = slope * tokens + intercept (slope: bytes per token), and a link's
alpha-beta model t = latency + bytes / bandwidth (`fit_link`, relative weights since sizes span decades),
or the cost model's own ring-step form t = max(latency, offset + bytes / bandwidth) (the paper's
two-regime T_comm, `fit_two_regime`, minimax).
Whole training steps fit one factor k against the modeled steps (`fit_step_scale`).
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
    """Least-squares line through (forward FLOPs, seconds), weighted by 1/seconds so that it minimizes the
    *relative* residuals (cases span a decade of sizes: plain least squares would fit the largest and
    leave the small ones, where the per-micro-batch constant shows, far off); see the module docstring
    for the mapping to the profile."""
    f = np.asarray(flops, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if f.shape != t.shape or f.size < 2 or np.ptp(f) <= 0:
        raise ValueError("fit_compute needs at least two measurements with different FLOPs")
    if np.any(t <= 0):
        raise ValueError("fit_compute needs positive times")
    slope, intercept = np.polyfit(f, t, 1, w=1.0 / t)
    if slope <= 0:
        raise ValueError("measured time does not grow with FLOPs: use a larger --max-tokens "
                         "(or more --repeats)")
    residual = np.abs(slope * f + intercept - t) / t
    return ComputeFit(
        slope_s_per_flop=float(slope), intercept_s=float(intercept),
        mfu=float(profile.train_flops_factor / (slope * profile.peak_flops)),
        micro_batch_launch_s=float(max(intercept, 0.0)), max_rel_residual=float(residual.max()),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearFit:
    """y = slope * x + intercept, fitted by `fit_linear`."""

    slope: float
    intercept: float
    max_rel_residual: float
    """max_i |fit(x_i) - y_i| / y_i."""

    def predict(self, x: float) -> float:
        return self.slope * x + self.intercept


def _line(x: np.ndarray, y: np.ndarray, relative: bool) -> tuple[float, float]:
    # Weighted least squares: polyfit minimizes sum_i (w_i * (fit(x_i) - y_i))^2, so w_i = 1 / y_i
    # minimizes the squared *relative* residuals.
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y if relative else None)
    return float(slope), float(intercept)


def fit_linear(x: Sequence[float], y: Sequence[float], *, relative: bool = False) -> LinearFit:
    """Least-squares line y = slope * x + intercept through measured (x_i, y_i), y_i > 0.

    relative=False minimizes sum_i (slope * x_i + intercept - y_i)^2 (ordinary least squares);
    relative=True minimizes sum_i ((slope * x_i + intercept - y_i) / y_i)^2, which weights every point
    alike when the y_i span orders of magnitude (small points would otherwise not count).
    max_rel_residual = max_i |slope * x_i + intercept - y_i| / y_i says how linear the data are.
    """
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(f"fit_linear needs x and y of one same length, got shapes {xs.shape} and {ys.shape}")
    if np.unique(xs).size < 2:
        raise ValueError("fit_linear needs measurements at at least two distinct x values")
    if not np.all(np.isfinite(xs)) or not np.all(np.isfinite(ys)) or np.any(ys <= 0):
        raise ValueError(f"fit_linear needs finite x and positive y, got y = {ys.tolist()}")
    slope, intercept = _line(xs, ys, relative)
    residual = np.abs(slope * xs + intercept - ys) / ys
    return LinearFit(slope=slope, intercept=intercept, max_rel_residual=float(residual.max()))


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    """A link's time per transfer: t(bytes) = latency_s + bytes / bandwidth (alpha-beta, `fit_link`), or
    with `two_regime` max(latency_s, offset_s + bytes / bandwidth) (the cost model's ring step, the paper's
    two-regime T_comm, `fit_two_regime`)."""

    latency_s: float
    bandwidth: float
    """Bytes per second."""
    max_rel_residual: float
    """max_i |t(bytes_i) - t_i| / t_i of this (latency-clipped) model."""
    two_regime: bool = False
    offset_s: float = 0.0
    """b_c of the two-regime line a_c*V + b_c (0 in the alpha-beta form, whose intercept is latency_s)."""

    def predict(self, nbytes: float) -> float:
        if self.two_regime:
            return max(self.latency_s, self.offset_s + nbytes / self.bandwidth)
        return self.latency_s + nbytes / self.bandwidth


def fit_link(nbytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Latency and bandwidth of a link from the times of transfers of different sizes.

    The alpha-beta model t = latency + bytes / bandwidth is a line t = slope * bytes + intercept, fitted
    with relative weights (message sizes span decades: ordinary least squares would fit the largest
    transfers only and leave the latency to their noise), so

        bandwidth = 1 / slope
        latency_s = intercept, clipped at 0 (a negative intercept is noise around a latency too small
                    for these sizes to resolve; max_rel_residual is that of the clipped model)
    """
    line = fit_linear(nbytes, seconds, relative=True)
    if line.slope <= 0:
        raise ValueError("measured transfer time does not grow with message size: measure larger sizes "
                         "(or more repeats)")
    latency = max(line.intercept, 0.0)
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    residual = np.abs(latency + b * line.slope - t) / t
    return LinkFit(latency_s=latency, bandwidth=1.0 / line.slope, max_rel_residual=float(residual.max()))


def fit_two_regime(nbytes: Sequence[float], seconds: Sequence[float], *,
                   through_origin: bool = False) -> LinkFit:
    """The cost model's ring step, t = max(latency, offset + bytes / bandwidth), fitted minimax-relative.

    This is the paper's two-regime T_comm: a fixed latency below a size threshold, a line a_c*V + b_c
    above it (`CostModel.t_comm`). The line's offset b_c matters on links that do not behave like an ideal
    pipe: gloo on 2 shared CPU cores measured 92 us at 4 KiB and 64 KiB, 128 us at 256 KiB and 339 us at
    1 MiB, which no max(latency, bytes / bandwidth) fits better than 16.4% (`through_origin=True` is that
    form); with the offset the four points fit exactly.

    Candidates, each scored by its largest relative residual (n <= a dozen sizes, so brute force is cheap):
      lines     through every pair of measured points, the relative least-squares line of every suffix of
                the sizes (the bandwidth-bound tail), and through the origin and every point
      latencies every measured time, and 2*t_a*t_b / (t_a + t_b) for every pair (the constant whose
                relative errors against t_a and t_b are equal and opposite: the minimax of a flat regime)
    """
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if b.shape != t.shape or b.size < 2 or np.any(t <= 0) or np.any(b <= 0):
        raise ValueError("fit_two_regime needs at least two transfers with positive sizes and times")
    order = np.argsort(b)
    b, t = b[order], t[order]
    lines = _candidate_lines(b, t, through_origin)
    equalizers = 2 * t[:, None] * t[None, :] / (t[:, None] + t[None, :])
    latencies = np.unique(np.concatenate([t, equalizers.ravel()]))
    best: tuple[float, float, float, float] | None = None
    for slope, offset in lines:
        predicted = np.maximum(latencies[:, None], offset + slope * b[None, :])  # [latency, size]
        residual = np.max(np.abs(predicted - t) / t, axis=1)
        i = int(np.argmin(residual))
        if best is None or residual[i] < best[0]:
            best = (float(residual[i]), float(latencies[i]), float(slope), float(offset))
    if best is None:
        raise ValueError("measured transfer time does not grow with message size: measure larger sizes "
                         "(or more repeats)")
    residual, latency, slope, offset = best
    return LinkFit(latency_s=latency, bandwidth=1.0 / slope, offset_s=offset, max_rel_residual=residual,
                   two_regime=True)


def _candidate_lines(b: np.ndarray, t: np.ndarray, through_origin: bool) -> list[tuple[float, float]]:
    """(slope, offset) lines with a positive slope for fit_two_regime (sizes sorted ascending)."""
    lines = [(float(ti / bi), 0.0) for bi, ti in zip(b, t, strict=True)]
    if not through_origin:
        n = b.size
        for i in range(n):
            for j in range(i + 1, n):
                if b[j] > b[i]:
                    slope = (t[j] - t[i]) / (b[j] - b[i])
                    lines.append((float(slope), float(t[i] - slope * b[i])))
        for start in range(n - 1):
            slope, offset = _line(b[start:], t[start:], relative=True)
            lines.append((slope, offset))
    return [(slope, offset) for slope, offset in lines if slope > 0]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepScaleFit:
    """measured step ~= scale * the isolated terms' predicted step, fitted by `fit_step_scale`."""

    scale: float
    max_rel_residual: float
    """max_i |scale * predicted_i - measured_i| / measured_i: how well whole steps are predicted after."""
    max_rel_residual_before: float
    """The same with scale 1: how far the isolated measurements alone predict whole steps."""


def fit_step_scale(predicted: Sequence[float], measured: Sequence[float]) -> StepScaleFit:
    """The factor k minimizing sum_i ((k p_i - m_i) / m_i)^2, i.e. k = sum(p/m) / sum((p/m)^2).

    Whole training steps can run slower than the sum of their parts timed in isolation (each part repeats
    one shape on warm caches; a real step varies shapes, crosses the accumulation boundary, touches the
    optimizer state). Every term of the cost model is homogeneous of degree 1 in time (compute, launch,
    latency x k; bandwidths / k), so scaling them all by k scales every modeled step by exactly k and
    leaves every planning decision (argmins of modeled time) unchanged.
    """
    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    if p.shape != m.shape or p.size < 1 or np.any(p <= 0) or np.any(m <= 0):
        raise ValueError("fit_step_scale needs at least one step with positive predicted and measured times")
    ratio = p / m
    scale = float(ratio.sum() / (ratio**2).sum())
    return StepScaleFit(scale=scale, max_rel_residual=float(np.max(np.abs(scale * ratio - 1))),
                        max_rel_residual_before=float(np.max(np.abs(ratio - 1))))
