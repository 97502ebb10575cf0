"""Every reported step's metrics to Weights & Biases, when train.wandb_project is set (the driver's progress
thread; the W&B counterpart of app/sinks/mlflow.py).

    train.wandb_project: ""          off (the default)
                         my-project  one W&B run per Skrull run in that project
    train.wandb_entity:  ""          the API key's default entity (user or team); or a team's name

One W&B run per Skrull run: named run.name, with the config (the snapshot app/rundir/snapshot.py writes,
nested: W&B shows `train.lr`, `model.name_or_path`, ... and keeps numbers as numbers) and each step's numeric
metrics (the same scalars as TensorBoard and MLflow, app/sinks/tensorboard.py; non-finite values left out)
with the training step as W&B's own step. The run id is drawn once and kept in <run_dir>/wandb_run.json, so
a rerun of the run directory continues the same W&B run (resume="allow"; a changed project or entity
starts a new one). W&B's own files go to <run_dir>/wandb/; WANDB_MODE=offline writes only those (upload
later with `wandb sync <run_dir>/wandb/offline-run-*`).

Steps: W&B drops a step lower than one it already has, with a warning of its own. A group restarted from an
older checkpoint trains some steps again, so this sink logs only steps above the last one the run holds
(W&B's starting step on a resume, then each logged one): the first value of a re-trained step stays in W&B,
metrics.jsonl keeps both. (Chosen over a custom step metric so W&B's default x axis is the training step.)

Never a prompt, never captured output: online without credentials (WANDB_API_KEY, `wandb login`) is refused
before wandb.init could ask for a key, and console capture is off. wandb is imported lazily: it is the
project's optional `wandb` extra, checked at preflight (check_wandb). A project W&B refuses (bad key,
no such entity, no network) is a ConfigError before the workers start; a W&B failure mid-run does not stop
training: the first failed write prints one warning and the sink turns itself off.
"""

from __future__ import annotations

import contextlib
import importlib.util
import secrets
import sys
from pathlib import Path
from typing import Any, TextIO

from app.config import ConfigError
from app.rundir.files import WANDB_RUN_FILE, read_json, write_json
from app.sinks.base import RunStatus
from app.sinks.tensorboard import scalars

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_ID_LENGTH = 12


def check_wandb(project: str) -> None:
    """Preflight: a set train.wandb_project needs wandb importable (ConfigError naming the key and extra)."""
    if project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"train.wandb_project={project!r} is set but wandb is not installed; install the "
                          "extra (pip install -e '.[wandb]' in the checkout) or unset train.wandb_project")


def new_run_id() -> str:
    """A fresh W&B run id: 12 random lowercase letters and digits (what W&B accepts in an id and a URL)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))


def _first_line(err: BaseException) -> str:
    """`Type: first line of the message` (W&B's messages can run over many lines)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _require_credentials(project: str) -> None:
    """Online W&B needs an API key found without asking (env, settings file, .netrc): refuse otherwise,
    before wandb.init would prompt for one. Offline and disabled modes need none."""
    import wandb

    if wandb.setup().settings.mode in ("offline", "dryrun", "disabled"):
        return
    if not wandb.login(prompt=False, verify=False):
        raise ConfigError(f"train.wandb_project={project!r}: no W&B credentials (set WANDB_API_KEY or run "
                          "`wandb login`; WANDB_MODE=offline logs to the run directory only), or unset "
                          "train.wandb_project")


class WandbLog:
    """One Skrull run's W&B run: the config once, metrics per step (see the module docstring)."""

    def __init__(self, project: str, entity: str, run_dir: str | Path, run_name: str,
                 config: dict[str, Any], *, out: TextIO | None = None) -> None:
        self._out = out or sys.stderr
        self._path = Path(run_dir) / WANDB_RUN_FILE
        _require_credentials(project)
        run_id = self._saved_run_id(project, entity) or new_run_id()
        try:
            self._run: Any = self._start(project, entity, Path(run_dir), run_name, run_id, config)
        except Exception as err:  # before training: a project W&B refuses is the user's to fix
            raise ConfigError(f"train.wandb_project={project!r}: W&B refused it ({_first_line(err)}); fix "
                              "the project, train.wandb_entity or the credentials, or unset "
                              "train.wandb_project") from None
        write_json(self._path, {"project": project, "entity": entity, "run_id": run_id})
        self.run_id = run_id
        self._next_step = int(self._run.starting_step)  # W&B's next step: above what a resumed run holds
        self._logging = True

    def _saved_run_id(self, project: str, entity: str) -> str | None:
        """The W&B run id of an earlier `train` call of this run directory (same project and entity)."""
        saved = read_json(self._path)
        if not saved or (saved.get("project"), saved.get("entity")) != (project, entity):
            return None
        return str(saved["run_id"])

    @staticmethod
    def _start(project: str, entity: str, run_dir: Path, run_name: str, run_id: str,
               config: dict[str, Any]) -> Any:
        """wandb.init of run `run_id` (created, or resumed when W&B has it), its files under run_dir/wandb."""
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(project=project, entity=entity or None, name=run_name, id=run_id, resume="allow",
                          config=config, allow_val_change=True, dir=str(run_dir), reinit="create_new",
                          settings=wandb.Settings(console="off", symlink=False))

    def write(self, metrics: dict[str, Any]) -> None:
        """Log one step record's finite numeric metrics at its step (a step W&B already has is skipped)."""
        step = int(metrics["step"])
        if not self._logging or step < self._next_step:
            return
        values = {key: value for key, value in scalars(metrics).items()
                  if value == value and abs(value) != float("inf")}
        try:
            self._run.log(values, step=step)
        except Exception as err:  # a W&B failure never stops training
            print(f"warning: W&B logging stopped (train.wandb_project): {_first_line(err)}; metrics.jsonl "
                  "and TensorBoard keep every step", file=self._out, flush=True)
            self._logging = False
            return
        self._next_step = step + 1

    def close(self, status: RunStatus = RunStatus.FINISHED) -> None:
        """Finish the W&B run: exit code 0 for FINISHED, 1 for FAILED or KILLED (never raises; after a
        failed write too, so W&B's own process ends with the run)."""
        if self._run is not None:
            with contextlib.suppress(Exception):
                self._run.finish(exit_code=0 if status == RunStatus.FINISHED else 1)
            self._run, self._logging = None, False
