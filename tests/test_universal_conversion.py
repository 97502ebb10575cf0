"""The universal-checkpoint conversion that runs beside an engine build (workers/checkpoints.py): its
failures are one error carrying the converter's output, and nothing half-written stays behind.

A successful conversion, loaded on another world size, is tests/test_resilience.py's resume on fewer and
more workers and tests/test_elastic_cluster.py's shrink and grow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.checkpoints import CheckpointState, converting_to_universal

STATE = CheckpointState(step=2, epoch=0, rows=16, tag="step2", world_size=2, dp_size=2, cp_size=1)


def test_a_failed_conversion_raises_with_the_converters_output_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "universal"
    built = []
    with (pytest.raises(RuntimeError, match=r"converting checkpoint step2 \(DP 2 x CP 1\)[\s\S]*step2"),
          converting_to_universal(tmp_path / "no-checkpoint", STATE, out)):
        built.append("engine")  # the body (the engine build) runs while the converter does
    assert built == ["engine"]
    assert list(out.iterdir()) == []  # no staging directory, no step2_universal


def test_an_error_in_the_body_stops_the_converter_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "universal"
    with (pytest.raises(ValueError, match="engine build failed"),
          converting_to_universal(tmp_path / "no-checkpoint", STATE, out)):
        raise ValueError("engine build failed")
    assert list(out.iterdir()) == []


def test_a_finished_conversion_is_not_redone(tmp_path: Path) -> None:
    done = tmp_path / "universal" / "step2_universal"
    done.mkdir(parents=True)
    with converting_to_universal(tmp_path / "no-checkpoint", STATE, tmp_path / "universal"):
        pass  # no converter started: it would fail on the missing checkpoint
    assert [p.name for p in (tmp_path / "universal").iterdir()] == ["step2_universal"]
