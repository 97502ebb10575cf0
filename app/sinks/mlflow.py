"""Every reported step's metrics to MLflow, when train.mlflow_uri is set (the driver's progress thread).

    train.mlflow_uri: ""                         off (the default)
                      sqlite:///mlflow.db        a local database (needs `pip install sqlalchemy alembic`)
                      http://tracking:5000       a tracking server (production)

One MLflow run per Skrull run: named run.name, in the experiment $MLFLOW_EXPERIMENT_NAME (default
"skrull"); the flattened config is logged once as params (`model.name_or_path`, `train.lr`, ...) and each
step's numeric metrics (the same scalars as TensorBoard, app/sinks/tensorboard.py) with the step as x axis.
The run id is kept in <run_dir>/mlflow_run.json, so a resumed run continues the same MLflow run (same
tracking URI and the run still there; otherwise it starts a new one). mlflow is imported lazily: it is the
project's optional `mlflow` extra (mlflow-skinny), checked at preflight (check_mlflow).

A tracking server that fails mid-run does not stop training: the first failed write prints one warning
and the sink turns itself off (the run's metrics.jsonl and TensorBoard files still have every step).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from app.config import ConfigError
from app.rundir.files import MLFLOW_RUN_FILE, read_json, write_json
from app.sinks.base import RunStatus
from app.sinks.tensorboard import scalars

DEFAULT_EXPERIMENT = "skrull"
_BATCH = 100  # MLflow accepts at most 100 params per log_batch call (MAX_PARAMS_TAGS_PER_BATCH)


def check_mlflow(uri: str) -> None:
    """Preflight: a set train.mlflow_uri needs mlflow importable (ConfigError naming the key and extra)."""
    if uri and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"train.mlflow_uri={uri!r} is set but mlflow is not installed; install the extra "
                          "(pip install -e '.[mlflow]' in the checkout) or unset train.mlflow_uri")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 0.003}} -> {"train.lr": "0.003"}: the config as MLflow params."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{name}.")
        else:
            flat[name] = str(value)
    return flat


class MlflowLog:
    """One Skrull run's MLflow run: params once, metrics per step (see the module docstring)."""

    def __init__(self, uri: str, run_dir: str | Path, run_name: str, config: dict[str, Any], *,
                 out: TextIO | None = None) -> None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        self._out = out or sys.stderr
        self._path = Path(run_dir) / MLFLOW_RUN_FILE
        try:
            self._client = MlflowClient(tracking_uri=uri)
            self.run_id = self._resumed_run(uri) or self._new_run(uri, run_name, config)
        except (MlflowException, OSError) as err:  # before training: an unusable URI is the user's to fix
            raise ConfigError(f"train.mlflow_uri={uri!r}: MLflow refused it ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); fix or unset "
                              "train.mlflow_uri") from None

    def _new_run(self, uri: str, run_name: str, config: dict[str, Any]) -> str:
        """A new MLflow run with the config as params, recorded in the run directory."""
        run_id = self._client.create_run(self._experiment_id(), run_name=run_name).info.run_id
        self.run_id = run_id
        self._log_params(flatten(config))
        write_json(self._path, {"tracking_uri": uri, "run_id": run_id})
        return run_id

    def _resumed_run(self, uri: str) -> str | None:
        """The MLflow run of an earlier `train` call of this run directory, marked running again."""
        from mlflow.exceptions import MlflowException

        saved = read_json(self._path)
        if not saved or saved.get("tracking_uri") != uri:
            return None
        try:
            self._client.update_run(saved["run_id"], status="RUNNING")
        except MlflowException:  # deleted, or another store behind the same URI: start a new run
            return None
        return str(saved["run_id"])

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self._client.create_experiment(name)
        except MlflowException:  # another run created it first
            return self._client.get_experiment_by_name(name).experiment_id

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in params.items()]
        for begin in range(0, len(items), _BATCH):
            self._client.log_batch(self.run_id, params=items[begin:begin + _BATCH])

    def write(self, metrics: dict[str, Any]) -> None:
        """Log one step record's numeric metrics (non-finite values left out)."""
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        if self.run_id is None:
            return
        now, step = int(time.time() * 1000), int(metrics["step"])
        batch = [Metric(key, value, now, step) for key, value in scalars(metrics).items()
                 if value == value and abs(value) != float("inf")]
        try:
            self._client.log_batch(self.run_id, metrics=batch)
        except (MlflowException, OSError) as err:
            print(f"warning: MLflow logging stopped (train.mlflow_uri): {type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}; metrics.jsonl and TensorBoard keep "
                  "every step", file=self._out, flush=True)
            self.run_id = None

    def close(self, status: RunStatus = RunStatus.FINISHED) -> None:
        """Mark the MLflow run FINISHED, FAILED or KILLED."""
        from mlflow.exceptions import MlflowException

        if self.run_id is not None:
            # A failing server: the warning was printed by write(); a removed run: nothing to mark.
            with contextlib.suppress(MlflowException, OSError):
                self._client.set_terminated(self.run_id, status=status)
