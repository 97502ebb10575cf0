"""The `train` driver: preflight, the run directory, Ray, data, planner actor, Ray Train workers, summary.

    preflight (no Ray) ─▶ run lock, resume check, snapshot (app/rundir/) ─▶ ray_session (embedded, or
        RAY_ADDRESS; app/train/cluster.py) ─▶ prepared_data: tokenized once, scanned (app/train/dataset.py)
        ─▶ PlannerActor + RunMonitor + TorchTrainer (app/train/components.py)
        ─▶ fit_with_progress: the metric sinks, the progress bar, fit (app/train/fit.py) ─▶ TrainSummary

What preflight resolved about the data (app/data/resolved.py: sources, tokenizer, template, fingerprints)
is handed down, so the driver resolves and loads each once. `bench train` (app/bench/driver.py) and
`profile` run the same pieces.
"""

from __future__ import annotations

import _thread
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from app.config import SkrullConfig
from app.rundir.files import CONFIG_SNAPSHOT
from app.rundir.location import run_name, run_storage
from app.rundir.lock import run_lock
from app.rundir.resume_checkpoints import set_aside_unloadable_checkpoints
from app.rundir.snapshot import check_resume, write_snapshot
from app.train.cluster import on_this_node, ray_session
from app.train.components import (
    make_trainer,
    planner_actor,
    run_location_of,
    steps_line,
    total_steps_of,
    worker_settings,
)
from app.train.console import run_console
from app.train.dataset import prepared_data
from app.train.failures import one_line_failures, stop_reason
from app.train.fit import fit_with_progress
from app.train.preflight import check_model_source, preflight
from app.train.signals import RunInterrupted, Terminated, sigterm_stops_like_ctrl_c
from workers.phase_clock import PhaseClock
from workers.storage import pull_mirror

if TYPE_CHECKING:
    from app.data.resolved import ResolvedData


@dataclass(frozen=True, slots=True)
class TrainSummary:
    steps: int
    samples: int
    tokens: int
    loss_first: float
    loss_last: float
    tokens_per_s: float
    checkpoint: str | None
    run_dir: str
    resumed_from_step: int | None
    """The checkpoint step this call resumed from (None: a fresh run)."""
    restarts: int
    """Worker-group restarts during this call (worker failures, planner failures, elastic resizes)."""
    export: str | None
    """<run_dir>/hf/, the trained model as a Hugging Face directory (train.export_on_finish), or None."""
    history: list[dict[str, float]]
    """Every step's reported metrics (loss, tokens_per_s, step_s, planner_wait_s, ...), in step order."""
    wall_s: float = 0.0
    """This call's wall seconds, from its start to the summary: with the steps' step_s and the first step's
    engine_s and warmup_s, what a run spends outside its steps (Ray, data, start-up, the final save)."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """The driver's own split of wall_s (PhaseClock: time.monotonic, consecutive, in this order; their sum
    is wall_s up to the summary's making):
    preflight  the model's dimensions and bucket size resolved, the data resolved (preflight), the run's
               lock, resume check, config snapshot and console: everything before Ray
    ray_start  ray_session entered (an embedded Ray started, or RAY_ADDRESS's joined)
    data       prepared_data: the rows tokenized once and scanned (Ray Data)
    planner    the planner's data put in the object store, the PlannerActor, RunMonitor and TorchTrainer made
    workers    fit_with_progress, from the trainer's fit start to its end: the worker group started, each
               worker's engine built and warmed up, the steps, the checkpoints (the last step's
               checkpoint_s), the workers' export streaming (train.export_on_finish), the group's end
    shutdown   ray_session left (an embedded Ray shut down)
    export     publish_export (train.export_on_finish; else ~0): the driver completes and publishes hf/
    finish     the console closed (a remote run's mirror pushed to its storage), the run's lock released"""

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]

    def to_json_dict(self) -> dict[str, Any]:
        """The public `train --json` summary: the totals, without the per-step history."""
        from app.rundir.files import jsonable

        result = asdict(self)
        del result["history"]
        return jsonable(result)  # a skipped (non-finite) last step's loss: null, never a NaN literal




@one_line_failures  # a stopped run or a storage error: RunFailed, one line (app/train/failures.py)
def train(config: SkrullConfig, *, progress: bool = True, quiet: bool = False, worker_logs: bool = True,
          out: TextIO | None = None) -> TrainSummary:
    """Run a whole training job; raises ConfigError (or a subclass) on bad input before workers start.

    quiet: everything the libraries print goes to <run_dir>/logs/driver.log (app/train/console.py) and the
    terminal shows only the data summary, the progress bar and warnings; `out` is where those go.
    Ctrl-C and SIGTERM stop the call alike (RunInterrupted). The run's lock (app/rundir/lock.py) is held
    from before its first write to the end: a second call on the same run stops with RunLocked.
    """
    started = time.monotonic()
    clock = PhaseClock(started)
    check_model_source(config.model)  # a hub id's config.json into the local cache: the dimensions' source
    config = _with_bucket_size(config, out)
    name = run_name(config)
    try:
        with sigterm_stops_like_ctrl_c():
            summary = _train_locked(config, name, progress=progress, quiet=quiet, worker_logs=worker_logs,
                                    out=out, clock=clock)
            clock.lap("finish")
            return replace(summary, wall_s=time.monotonic() - started, phases_s=clock.phases)
    except KeyboardInterrupt as err:  # Ray (embedded: every process of it) is already shut down here
        stopped_by = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
        raise RunInterrupted(name, run_location_of(config, name), stopped_by) from err


def _with_bucket_size(config: SkrullConfig, out: TextIO | None) -> SkrullConfig:
    """train.activation_checkpointing=auto chosen by the planner (app/profiling/checkpointing.py) and
    scheduling.bucket_size=auto derived from memory (app/profiling/memory.py), each said once in a line,
    over the model's own dimensions (app/model/dims.py: from its config.json, a model.* value it
    contradicts a ConfigError; where none can be read, the config's, said in a line)."""
    from app.model.dims import dims_note, resolved_model
    from app.profiling.budget import resolve_bucket_size
    from app.train.preflight import check_local_cpu_memory

    resolved_model(config.model)
    check_local_cpu_memory(config)  # before C is sized from a profile this host cannot hold
    note = dims_note(config.model)
    if note:
        print(note, file=out or sys.stderr, flush=True)
    resolved, budget = resolve_bucket_size(config)
    if budget.checkpointing is not None:
        print(budget.checkpointing.line(), file=out or sys.stderr, flush=True)
    if budget.source == "memory":
        print(budget.line(), file=out or sys.stderr, flush=True)
    return resolved


def _train_locked(config: SkrullConfig, name: str, *, progress: bool, quiet: bool, worker_logs: bool,
                  out: TextIO | None, clock: PhaseClock) -> TrainSummary:
    """preflight, the run's lock, the resume check and snapshot, then the run under its console."""
    data = preflight(config)
    run = run_storage(config, name)
    existed = run.exists()
    with run_lock(run, out=out, on_lost=_thread.interrupt_main):  # a lost lease stops the call (Ctrl-C)
        set_aside_unloadable_checkpoints(run)  # app/rundir/resume_checkpoints.py: resume only what loads
        resuming = check_resume(config, run, data.fingerprints)
        if write_snapshot(config, run, template=data.chat_template_text, data=data.fingerprints,
                          fresh=not resuming):
            print(f"run {name!r} has no complete checkpoint to resume: it starts fresh with this config "
                  f"({CONFIG_SNAPSHOT} replaced)", file=out or sys.stderr, flush=True)
        # A remote run's driver-side files (logs/, tensorboard/, ...) live in a local mirror that is copied
        # into the run's storage at the end (workers/storage.py: pull_mirror, push_mirror).
        run_dir = run.local or pull_mirror(run)
        remote = None if run.is_local else run
        with run_console(run_dir, quiet=quiet, out=out, existed=existed, remote=remote) as terminal:
            return _run(config, data, name, run_dir, progress=progress, worker_logs=worker_logs, out=terminal,
                        clock=clock)


def _run(config: SkrullConfig, data: ResolvedData, name: str, run_dir: Path, *, progress: bool,
         worker_logs: bool, out: TextIO, clock: PhaseClock) -> TrainSummary:
    clock.lap("preflight")
    with ray_session(config, worker_logs=worker_logs) as embedded:
        clock.lap("ray_start")
        reports, checkpoint, starts = _fit(config, data, name, run_dir, progress=progress, out=out,
                                           embedded=embedded, clock=clock)
    clock.lap("shutdown")
    # A restarted worker group re-runs the steps after its checkpoint: the last report of a step counts.
    history = sorted({h["step"]: h for h in reports}.values(), key=lambda h: h["step"])
    total_time = sum(h["step_s"] for h in history)
    resumed = int(starts[0]["resumed_from_step"]) if starts else int(reports[0]["resumed_from_step"])
    export = None
    if config.train.export_on_finish and not stop_reason(history):  # the workers streamed the weights of
        # the last step (a stopped run has none): the driver adds the rest and publishes them as hf/
        from app.model.export import publish_export

        export = publish_export(config, str(run_location_of(config, name)), step=int(history[-1]["step"]),
                                template=data.chat_template_text, tokenizer=data.tokenizer)
        print(f"the trained model: {export} (AutoModelForCausalLM.from_pretrained"
              f"{'; a peft adapter' if config.model.lora.r else ''})", file=out, flush=True)
    clock.lap("export")
    return TrainSummary(
        steps=len(history), samples=sum(int(h["samples"]) for h in history),
        tokens=sum(int(h["tokens"]) for h in history), loss_first=history[0]["loss"],
        loss_last=history[-1]["loss"], tokens_per_s=sum(h["tokens"] for h in history) / max(total_time, 1e-9),
        checkpoint=checkpoint, run_dir=str(run_location_of(config, name)), resumed_from_step=resumed or None,
        restarts=max(len(starts) - 1, 0), export=export, history=[dict(h) for h in history],
    )


def _fit(config: SkrullConfig, data: ResolvedData, name: str, run_dir: Path, *, progress: bool, out: TextIO,
         embedded: bool, clock: PhaseClock
         ) -> tuple[list[dict[str, Any]], str | None, list[dict[str, Any]]]:
    """Tokenize, scan, start the planner and the workers (the phases data, planner, workers of `clock`).

    Returns (per-step metrics, final checkpoint path, the worker group's starts).
    """
    import ray

    from app.train.run_monitor import RunMonitor
    from scheduling.actor import PlannerData

    prepared = prepared_data(config, data, progress=progress, out=out, embedded=embedded, run_dir=run_dir)
    clock.lap("data")
    total_steps = total_steps_of(config, prepared.usable_rows)
    if progress:
        print(steps_line(config, total_steps, prepared.usable_rows), file=out, flush=True)
    # Held until the run ends: Ray restarts a crashed planner from these references.
    planner_data = PlannerData.put(prepared.dataset, prepared.eval_dataset)
    planner = planner_actor(config, planner_data, total_steps, name, tokenizer=data.tokenizer)
    monitor = RunMonitor.options(scheduling_strategy=on_this_node()).remote()
    run = run_location_of(config, name)
    settings = worker_settings(config, planner, monitor, total_steps, run.uri, tokenizer=data.tokenizer)
    trainer = make_trainer(config, settings, name, monitor, embedded=embedded)
    clock.lap("planner")
    result, history = fit_with_progress(config, trainer, monitor, total_steps, progress=progress, out=out,
                                        run_dir=run_dir, run_name=name)
    if not history:
        raise RuntimeError(f"training reported no step; see the log in {run_dir / 'logs'}")
    checkpoint = None
    if result.checkpoint is not None:  # a remote run's checkpoint as a URI (Ray Train gives a bucket path)
        checkpoint = result.checkpoint.path if run.is_local else str(run / Path(result.checkpoint.path).name)
    starts = ray.get(monitor.starts.remote())
    clock.lap("workers")
    return history, checkpoint, starts
