"""The metric sinks are opened and closed in one place (app/sinks/registry.py open_sinks): a sink that fails
never leaves another one open, and every sink learns how the run ended."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from app.config import ConfigError, load_config
from app.sinks.base import RunStatus
from app.sinks.registry import SINKS, SinkContext, open_sinks


class Recorder:
    """A sink that remembers what it was given; `fail_on` names the call that raises."""

    def __init__(self, name: str, fail_on: str = "") -> None:
        self.name, self.fail_on = name, fail_on
        self.records: list[dict[str, Any]] = []
        self.closed: list[RunStatus] = []

    def write(self, metrics: dict[str, Any]) -> None:
        if self.fail_on == "write":
            raise OSError(f"{self.name}: disk full")
        self.records.append(metrics)

    def close(self, status: RunStatus) -> None:
        self.closed.append(status)
        if self.fail_on == "close":
            raise OSError(f"{self.name}: server gone")


def _context(tmp_path: Path) -> SinkContext:
    return SinkContext(config=load_config("configs/tiny-cpu.yaml"), run_dir=tmp_path, run_name="run",
                       total_steps=3, out=io.StringIO())


def test_a_sink_failing_to_close_leaves_every_other_one_closed_with_the_runs_status(tmp_path: Path) -> None:
    sinks = [Recorder("a"), Recorder("b", fail_on="close"), Recorder("c")]
    with pytest.raises(OSError, match="b: server gone"), \
            open_sinks(_context(tmp_path), [lambda _, s=s: s for s in sinks]) as opened:
        for sink in opened:
            sink.write({"step": 1})
    assert [s.closed for s in sinks] == [[RunStatus.FINISHED]] * 3
    assert [s.records for s in sinks] == [[{"step": 1}]] * 3


@pytest.mark.parametrize(("error", "status"), [(RuntimeError("worker died"), RunStatus.FAILED),
                                               (KeyboardInterrupt(), RunStatus.KILLED)])
def test_a_run_that_stops_closes_every_sink_with_its_status(tmp_path: Path, error: BaseException,
                                                            status: RunStatus) -> None:
    """The run's own error is raised, not the failing close's (which prints a warning)."""
    sinks = [Recorder("a"), Recorder("b", fail_on="close"), Recorder("c")]
    context = _context(tmp_path)
    with pytest.raises(type(error)), open_sinks(context, [lambda _, s=s: s for s in sinks]):
        raise error
    assert [s.closed for s in sinks] == [[status]] * 3
    assert "closing Recorder after the run stopped failed: OSError: b: server gone" in context.out.getvalue()


def test_a_sink_that_cannot_open_closes_the_ones_opened_before_it(tmp_path: Path) -> None:
    opened_first = Recorder("first")

    def refused(context: SinkContext) -> Recorder:
        raise ConfigError("train.wandb_project='p': W&B refused it")

    never = Recorder("never")
    with pytest.raises(ConfigError, match="train.wandb_project"), \
            open_sinks(_context(tmp_path), [lambda _: opened_first, refused, lambda _: never]):
        pytest.fail("the block must not run")
    assert (opened_first.closed, never.closed) == ([RunStatus.FAILED], [])


def test_the_registry_opens_only_the_configured_sinks(tmp_path: Path) -> None:
    """run_log and tensorboard always; mlflow and wandb only with their keys set (tiny-cpu sets neither)."""
    with open_sinks(_context(tmp_path)) as opened:
        names = [type(sink).__name__ for sink in opened]
    assert list(SINKS) == ["run_log", "tensorboard", "mlflow", "wandb"]
    assert names == ["RunLog", "TensorBoardLog"]
    assert (tmp_path / "tensorboard").is_dir()
