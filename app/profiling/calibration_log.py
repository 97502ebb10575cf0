"""Online calibration on the driver: each new fit written to the run directory, and one line about it.

The planner refits the profile from the run's own steps (scheduling/refit.py); the step where a new fit
first plans carries it in its metrics (`calibration`, workers/metrics.py). `CalibrationLog`, a line sink of
the progress bar (app/train/fit.py), then

    writes <run_dir>/fitted_profile.yaml   the fitted profile as a hardware profile file: set
                                           hardware.profile=<run_dir>/fitted_profile.yaml to start a run
                                           with it (the run itself resumes with it from its checkpoints)
    returns one line, the first time       how far hardware.profile predicted the run's micro-batches off,
                                           what the fit changed, and how far off it is now

It takes the place of the stale-profile warning (app/profiling/stale_check.py), which stays for
scheduling.calibration=off. `calibration_summary` is the same story for `report`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduling.cost import HardwareProfile

FITTED_PROFILE = "fitted_profile.yaml"


def fitted_profile_yaml(record: dict[str, Any], base: str) -> str:
    """The fit's profile as a loadable hardware profile (app/profiling/hardware.py), with its story."""
    steps = record["steps"]
    lines = [f"# Fitted online from the run's own micro-batches (scheduling/refit.py): fit "
             f"{record['version']}, steps {steps[0]}-{steps[-1]}, {record['micro_batches']} micro-batches,",
             f"# starting from hardware.profile={base}; median micro-batch error "
             f"{record['error_before']:.1%} before this fit, {record['error_after']:.1%} after."]
    names = {f.name for f in dataclasses.fields(HardwareProfile)}
    for key, value in record["profile"].items():
        if key in names:
            lines.append(f"{key}: {value!r}")  # every digit: the same profile plans the same plans
    return "\n".join(lines) + "\n"


def correction_line(record: dict[str, Any], base: str, where: Path) -> str:
    """How far hardware.profile was off, what the fit changed, how far off it is now."""
    return (f"calibration: hardware.profile={base} predicted this run's micro-batches "
            f"{record['error_before']:.0%} off (median); refitted from steps {_span(record['steps'])}: "
            f"{describe_factors(record['factors'])}; now {record['error_after']:.0%} off ({where})")


def describe_factors(factors: dict[str, float]) -> str:
    return (f"compute x{factors['compute']:.2f}, ring x{factors['ring']:.2f}, micro-batch overhead "
            f"{factors['micro_batch_s'] * 1e3:.1f} ms, sharded sequence "
            f"{factors['ring_sequence_step_s'] * 1e3:.3g} ms per ring step and layer")


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


@dataclass
class CalibrationLog:
    """A progress-bar line sink (module docstring)."""

    profile: str
    """hardware.profile: what the run started from."""
    run_dir: Path
    said: bool = False

    def __call__(self, metrics: dict[str, Any]) -> str | None:
        record = metrics.get("calibration")
        if record is None:
            return None
        target = self.run_dir / FITTED_PROFILE
        staging = target.with_suffix(".yaml.tmp")
        staging.write_text(fitted_profile_yaml(record, self.profile))
        staging.replace(target)  # never a half-written profile
        if self.said:
            return None
        self.said = True
        return correction_line(record, self.profile, target)


def calibration_summary(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """`report`'s view of a run's online calibration: its newest fit, and how far the predictions were off
    over the first and the last steps (median |predicted - measured| / measured); None without a fit."""
    fits = [h["calibration"] for h in history if isinstance(h.get("calibration"), dict)]
    if not fits:
        return None
    errors = [abs(h["predicted_step_s"] - h["step_s"]) / h["step_s"] for h in history
              if isinstance(h.get("predicted_step_s"), float) and isinstance(h.get("step_s"), float)
              and h["step_s"] > 0]
    window = min(8, max(1, len(errors) // 2))
    newest = fits[-1]
    return {"fits": newest["version"], "steps": newest["steps"], "factors": newest["factors"],
            "profile": newest["profile"],
            "step_error_first": _median(errors[:window]), "step_error_last": _median(errors[-window:])}


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
