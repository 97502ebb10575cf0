"""The machine's own drift in a `bench train` run: the part of the prediction error every policy shares.

All policies run step n within one rotation (A B C D, seconds to a minute apart), each planned ahead by
its own planner. A machine that runs slower for a while (a neighbour on a shared host, a throttled core)
makes that rotation's steps slower than predicted whatever the plan; no cost model can foresee that when
it plans. Per counted step n:

    drift[n]  = median over the policies of measured / predicted of their step n     (1.10: 10% slow)

and per policy `prediction_abs_error_median_net_of_drift` = median over n of
|predicted * drift[n] / measured - 1|: the policy's error relative to the other policies' at the same
moment. It leaves out whatever every policy's prediction shares at a step: the machine's speed then, and
also a bias all the fits might share alike. What it keeps is what tells plans apart, which is the part
that decides the planner's choices (skrull keeps the candidate the model times fastest: a common factor
never changes which). A diagnostic, not a prediction: drift[n] is known only after every policy ran step n.

Needs at least three policies with predictions at every counted step (with two, the median is their mean,
and one policy's error would pass for the machine's); None otherwise.
"""

from __future__ import annotations

import statistics
from typing import Any

MIN_POLICIES = 3


def machine_drift(rows: dict[str, dict[str, Any]]) -> list[float] | None:
    """drift[n] per counted step (module docstring), or None when fewer than MIN_POLICIES predicted."""
    ratios = [_ratios(row) for row in rows.values()]
    usable = [r for r in ratios if r is not None]
    if len(usable) < MIN_POLICIES or len({len(r) for r in usable}) != 1:
        return None
    return [statistics.median(r[n] for r in usable) for n in range(len(usable[0]))]


def net_abs_error(row: dict[str, Any], drift: list[float] | None) -> float | None:
    """Median over the counted steps of |predicted * drift / measured - 1|; None without drift or
    predictions."""
    ratios = _ratios(row)
    if drift is None or ratios is None:
        return None
    return statistics.median(abs(d / r - 1) for r, d in zip(ratios, drift, strict=True))


def _ratios(row: dict[str, Any]) -> list[float] | None:
    """measured / predicted per counted step; None unless every step has both."""
    steps = row["per_step"]
    if not _predicted(steps):
        return None
    return [m / p for p, m in zip(steps["predicted_step_s"], steps["step_s"], strict=True)]


def _predicted(steps: dict[str, list[Any]]) -> bool:
    """Every counted step has a positive prediction and a positive measurement."""
    return bool(steps["step_s"]) and all(
        p is not None and p == p and p > 0 and m > 0  # p == p: not NaN
        for p, m in zip(steps["predicted_step_s"], steps["step_s"], strict=True))
