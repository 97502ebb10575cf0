"""Which metric sinks a `train` call opens, and the one place they are opened and closed.

    SINKS: run_log (always) ─ tensorboard (always) ─ mlflow (train.mlflow_uri) ─ wandb (train.wandb_project)

`open_sinks` opens them in that order inside one ExitStack and closes every opened one when the block
ends, with the run's status: FINISHED, KILLED (Ctrl-C / SIGTERM) or FAILED. A sink that fails to open
(W&B refusing the project: a ConfigError) or to close never leaves another one open: ExitStack runs
every close. After a finished run a close that fails is the call's error (the earlier ones chained to
it); after a failed or stopped run the run's own error stays the one raised, and a failing close only
prints a warning. A new sink is one factory here and one module beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from app.config import SkrullConfig
from app.sinks.base import MetricSink, RunStatus


@dataclass(frozen=True, slots=True)
class SinkContext:
    """What a sink factory may read: the run's directory, name, step count and config."""

    config: SkrullConfig
    run_dir: Path
    run_name: str
    total_steps: int
    out: TextIO
    """Where a sink prints a warning (the command's terminal)."""


SinkFactory = Callable[[SinkContext], MetricSink | None]
"""Opens one sink for a run, or returns None when the config does not ask for it."""


def _run_log(context: SinkContext) -> MetricSink:
    from app.sinks.run_log import RunLog

    return RunLog(context.run_dir)


def _tensorboard(context: SinkContext) -> MetricSink:
    from app.sinks.tensorboard import TensorBoardLog

    return TensorBoardLog(context.run_dir)


def _mlflow(context: SinkContext) -> MetricSink | None:
    from app.rundir.snapshot import snapshot_record
    from app.sinks.mlflow import MlflowLog

    uri = context.config.train.mlflow_uri
    if not uri:
        return None
    return MlflowLog(uri, context.run_dir, context.run_name, snapshot_record(context.config), out=context.out)


def _wandb(context: SinkContext) -> MetricSink | None:
    from app.rundir.snapshot import snapshot_record
    from app.sinks.wandb import WandbLog

    train = context.config.train
    if not train.wandb_project:
        return None
    return WandbLog(train.wandb_project, train.wandb_entity, context.run_dir, context.run_name,
                    snapshot_record(context.config), out=context.out)


SINKS: dict[str, SinkFactory] = {"run_log": _run_log, "tensorboard": _tensorboard, "mlflow": _mlflow,
                                 "wandb": _wandb}


@contextlib.contextmanager
def open_sinks(context: SinkContext,
               factories: Iterable[SinkFactory] = SINKS.values()) -> Iterator[tuple[MetricSink, ...]]:
    """Open every configured sink; on exit close each one opened with the run's status (module docstring)."""
    status = RunStatus.FAILED

    def close(sink: MetricSink) -> None:
        try:
            sink.close(status)
        except Exception as err:
            if status is RunStatus.FINISHED:
                raise
            # The run's own error is the one to report; this one only gets a line.
            print(f"warning: closing {type(sink).__name__} after the run stopped failed: "
                  f"{type(err).__name__}: {err}", file=context.out, flush=True)

    with contextlib.ExitStack() as stack:
        opened: list[MetricSink] = []
        for factory in factories:
            sink = factory(context)
            if sink is not None:
                stack.callback(close, sink)
                opened.append(sink)
        try:
            yield tuple(opened)
        except KeyboardInterrupt:
            status = RunStatus.KILLED
            raise
        status = RunStatus.FINISHED
