"""The stale-profile check of `train` (app/profiling/stale_check.py), fed step metrics as the progress
bar does."""

from __future__ import annotations

import math

import pytest

from app.profiling.stale_check import STALE_STEPS, StaleProfileCheck, median_ratio


def _metrics(step: int, measured: float, predicted: float) -> dict:
    return {"step": step, "step_s": measured, "predicted_step_s": predicted}


def test_one_warning_after_the_first_eight_steps_when_the_profile_is_three_times_off() -> None:
    check = StaleProfileCheck(profile="configs/hardware/cpu.yaml", config="runs/x/skrull_config.json",
                              total_steps=100)
    lines = [check(_metrics(step, 1.0 + step / 10, 3 * (1.0 + step / 10))) for step in range(1, 20)]
    assert [i for i, line in enumerate(lines) if line] == [STALE_STEPS - 1]  # once, at step 8
    warning = lines[STALE_STEPS - 1]
    assert "hardware.profile=configs/hardware/cpu.yaml" in warning and "200% slower" in warning
    assert "python -m app profile --config runs/x/skrull_config.json" in warning


def test_a_short_run_is_judged_on_all_its_steps_and_a_fresh_profile_is_quiet() -> None:
    short = StaleProfileCheck(profile="cpu", config="c.yaml", total_steps=3)
    assert [short(_metrics(s, 1.0, 0.25)) is not None for s in (1, 2, 3)] == [False, False, True]
    fresh = StaleProfileCheck(profile="cpu", config="c.yaml", total_steps=100)
    # the first step's warm-up is far off; the median over eight steps is what counts
    assert not any(fresh(_metrics(s, 5.0 if s == 1 else 1.0, 1.2)) for s in range(1, 30))


def test_a_restarted_group_does_not_count_a_step_twice() -> None:
    check = StaleProfileCheck(profile="cpu", config="c.yaml", total_steps=100)
    for step in (1, 2, 3, 2, 3, 2, 3, 4, 5, 6, 7):  # steps 2-3 re-trained after restarts
        assert check(_metrics(step, 1.0, 3.0)) is None
    assert check(_metrics(8, 1.0, 3.0)) is not None


def test_median_ratio_ignores_missing_predictions() -> None:
    assert median_ratio([(math.nan, 1.0), (2.0, 1.0), (4.0, 1.0), (3.0, 0.0)]) == pytest.approx(3.0)
    assert median_ratio([(math.nan, 1.0)]) is None
