"""The `train` driver: preflight, Ray, tokenize once, planner actor, Ray Train workers, summary.

    preflight (no Ray) ─▶ ray.init (embedded, or RAY_ADDRESS) ─▶ tokenized_dataset(...).materialize()
        ─▶ scan_dataset (too long? empty?) ─▶ PlannerActor(the same materialized blocks)
        ─▶ TorchTrainer(train_loop_per_worker).fit() ─▶ TrainSummary

The dataset is tokenized once per run: the scan and the planner's stream read the same materialized blocks
(the object store spills them to disk when they outgrow memory). `bench train` (app/bench/driver.py) runs
the same pieces: prepared_dataset, planner_actor, worker_settings, make_trainer, fit_with_progress.

Resources on a small machine: Ray Data's file-listing task needs one whole CPU even when every worker holds
a fraction, so an embedded Ray declares more logical CPUs than cores (cores + 2 by default; docs/design.md
§9).
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import math
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from app.config import ConfigError, SkrullConfig, TrainConfig
from app.rundir.lock import run_lock
from app.rundir.resume_checkpoints import set_aside_unloadable_checkpoints
from app.train.failures import one_line_failures
from app.train.preflight import (
    CONFIG_SNAPSHOT,
    check_resume,
    preflight,
    run_name,
    run_storage,
    write_snapshot,
)
from workers.storage import Location, pull_mirror, push_mirror


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
    history: list[dict[str, float]]
    """Every step's reported metrics (loss, tokens_per_s, step_s, planner_wait_s, ...), in step order."""

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]

    def to_json_dict(self) -> dict[str, Any]:
        """The public `train --json` summary: the totals, without the per-step history."""
        from app.rundir.files import jsonable

        result = asdict(self)
        del result["history"]
        return jsonable(result)  # a skipped (non-finite) last step's loss: null, never a NaN literal


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM on the driver: Ray is shut down; a re-run resumes from the newest complete
    checkpoint. `signal_number`: the signal that stopped it (SIGINT or SIGTERM)."""

    def __init__(self, name: str, run_dir: Path | Location, signal_number: int = signal.SIGINT) -> None:
        super().__init__(name)
        self.name = name
        self.run_dir = run_dir
        self.signal_number = signal_number


class Terminated(KeyboardInterrupt):
    """SIGTERM on the driver (what `ray job stop` and cluster schedulers send), raised like Ctrl-C's
    KeyboardInterrupt so that it takes the same way out: Ray shut down, the run lock released."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_stops_like_ctrl_c() -> Iterator[None]:
    """For the duration, SIGTERM raises Terminated on the main thread (elsewhere: nothing changes).

    ray.init replaces the process's SIGTERM handler with one that calls sys.exit(15) (ray/_private/
    worker.py, `init`): ray_session puts this one back after it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def ray_session(config: SkrullConfig, *, worker_logs: bool = True) -> Iterator[bool]:
    """Join RAY_ADDRESS's cluster, or start an embedded one sized for Ray Data + planner + workers.

    A Ray that is already initialized in this process is used as it is (and left running). An embedded Ray
    never attaches to another Ray on the machine by accident (`address="local"`), and while it runs
    RAY_ADDRESS names it, so that Ray Train's helper processes find this instance and not another one.
    Yields whether the Ray is an embedded one (it cannot grow: resources beyond it are an error).
    """
    import ray

    if ray.is_initialized():
        yield not os.environ.get("RAY_ADDRESS")
        return
    previous = os.environ.get("RAY_ADDRESS")
    sigterm = signal.getsignal(signal.SIGTERM)
    if previous:
        ray.init(address=previous, log_to_driver=worker_logs)
    else:
        from app.train.preflight import check_embedded_cpus

        num_cpus = config.resources.num_cpus or (os.cpu_count() or 1) + 2
        check_embedded_cpus(config, num_cpus)
        start_local_ray(num_cpus, log_to_driver=worker_logs)
    if sigterm is _raise_terminated and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, sigterm)  # ray.init replaced it (sigterm_stops_like_ctrl_c)
    try:
        yield not previous
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)


def start_local_ray(num_cpus: float, *, log_to_driver: bool) -> str:
    """Start an embedded Ray on loopback whose address every process of it knows; returns the address.

    The GCS port is chosen up front so that the address can go into its processes' environment: Ray Train's
    detached placement-group cleaner (and anything else calling Ray's state API from inside the cluster)
    resolves "the" cluster from RAY_ADDRESS, and without it picks the newest Ray on the machine, which may
    be someone's `ray start` cluster. The caller owns os.environ["RAY_ADDRESS"], set here for the driver.

    Loopback only (README "Where Ray comes from"): Ray 2.60's servers (the GCS, raylet, object manager
    and core worker gRPC servers, the dashboard and its agent, the runtime-env agent, the metrics
    exporters) bind loopback when the node IP is a loopback address, and otherwise the node IP or the
    wildcard (measured: "::" for the gRPC servers), so the node IP must really be 127.0.0.1. ray.init
    turns `_node_ip_address="127.0.0.1"` into the machine's reachable address (ray/_private/services.py
    `resolve_ip_for_localhost`) unless Ray's ENABLE_RAY_CLUSTER is off, which Ray reads once, at import,
    from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: both are switched off while ray.init starts the node (the
    processes it starts inherit the variable), then put back. The workers' torch.distributed store and
    gloo sockets: workers/loopback.py, and GLOO_SOCKET_IFNAME (the loopback interface) in its processes'
    environment.
    """
    import ray
    from ray._private import ray_constants

    from workers.tools.launch import free_port

    port = free_port()
    address = f"127.0.0.1:{port}"
    # The environment of every process of this Ray: the raylet inherits it from here and hands it to each
    # worker it starts. Not a job runtime_env: with one, the raylet starts every worker process of the
    # job through Ray's setup_worker.py, one more interpreter start each (~0.5 CPU-s).
    job_env = {"RAY_ADDRESS": address, "GLOO_SOCKET_IFNAME": loopback_interface(),
               # Ray Train's preemption watcher (an actor per worker group) waits for a node to be drained:
               # one machine has no other node to move to, and the actor costs ~3 CPU-s per group start.
               "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
    # RAY_GCS_SERVER_PORT: read by ray.init when it starts the head node.
    startup_env = {"RAY_GCS_SERVER_PORT": str(port), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"} | job_env
    saved = {key: os.environ.get(key) for key in startup_env}
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(startup_env)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", num_cpus=num_cpus, log_to_driver=log_to_driver,
                 _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1")
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    os.environ["RAY_ADDRESS"] = address
    return address


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 ("lo" on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


def _use_gpu(config: SkrullConfig) -> bool:
    return config.resources.gpus_per_worker > 0


def _total_steps(config: SkrullConfig, usable_rows: int) -> int:
    if config.train.steps:
        return config.train.steps
    steps = usable_rows // config.scheduling.global_batch_size * config.train.epochs
    if steps == 0:
        raise ConfigError(
            f"{usable_rows} usable rows make no full global batch of scheduling.global_batch_size="
            f"{config.scheduling.global_batch_size}; lower it or add data"
        )
    return steps


def planner_actor(config: SkrullConfig, dataset: Any, total_steps: int, name: str,
                  eval_dataset: Any = None) -> Any:
    """A PlannerActor for config.scheduling.policy over the materialized `dataset`, on the driver's node.

    The planner skips the rows data.eval_fraction holds out and, with data.shuffle (file and hub data),
    visits each epoch in a permutation seeded by (data.seed, epoch) (scheduling/order.py); `eval_dataset`
    is data.eval_path's materialized rows (PreparedData.eval_dataset), the eval set instead of the
    held-out rows, planned in stream order.
    """
    from app.profiling.hardware import cost_model
    from scheduling.actor import PlannerActor, PlannerSettings

    sched, par = config.scheduling, config.parallel
    settings = PlannerSettings(
        policy=sched.policy, dp_size=par.dp_size, cp_size=par.cp_size, bucket_size=sched.bucket_size,
        global_batch_size=sched.global_batch_size, total_steps=total_steps, prefetch=sched.prefetch,
        seed=sched.seed, static_cp_micro_batch=sched.static_cp_micro_batch,
        eval_fraction=config.data.eval_fraction, data_seed=config.data.seed,
        shuffle=config.data.shuffle and config.data.source != "synthetic",  # synthetic: random already
        cp_degrees=config.cp_degrees,
    )
    # Ray restarts a dead planner actor (a fresh one, planning from the run's start); the workers' own
    # restart then moves it to the checkpoint's cursor. Calls are never retried: a payload call answered
    # by a planner that restarted from the wrong place would hand out the wrong data.
    actor = PlannerActor.options(num_cpus=config.resources.planner_cpus, max_restarts=-1, max_task_retries=0,
                                 scheduling_strategy=on_this_node(),
                                 name=f"skrull-planner-{name}-{secrets.token_hex(3)}")  # for operators
    return actor.remote(dataset, settings, cost_model(config), eval_dataset=eval_dataset)


def on_this_node() -> Any:
    """Pin a driver-side actor (planner, progress monitor) to the driver's node: losing a worker node
    must not take them along (their state is the run's, not a worker's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def worker_settings(config: SkrullConfig, planner: Any, monitor: Any, total_steps: int, run_dir: str) -> Any:
    """The workers' WorkerSettings (model, DeepSpeed JSON, timeouts) from the config tree."""
    from app.model.deepspeed_config import deepspeed_config
    from app.model.spec import model_spec
    from app.profiling.hardware import model_dims
    from workers.nonfinite import NonFinitePolicy
    from workers.train_loop import WorkerSettings

    train = config.train
    return WorkerSettings(
        model=model_spec(config.model, train, tokenizer=config.data.tokenizer),
        deepspeed=deepspeed_config(train, dtype=config.model.dtype, on_gpu=_use_gpu(config),
                                   hidden_size=model_dims(config.model, config.data.tokenizer).hidden_size),
        cp_size=config.parallel.cp_size, cp_degrees=config.cp_degrees, total_steps=total_steps,
        loss_chunk_tokens=train.loss_chunk_tokens,
        checkpoint_every=train.checkpoint_every, log_every=train.log_every, run_dir=run_dir,
        planner=planner, monitor=monitor, seed=train.seed, collective_timeout_s=train.collective_timeout_s,
        planner_timeout_s=config.scheduling.planner_timeout_s, eval_every=train.eval_every,
        nonfinite=NonFinitePolicy(train.nonfinite, train.max_skipped_steps),
        lr_schedule=lr_schedule(train, total_steps),
    )


def lr_schedule(train: TrainConfig, total_steps: int) -> Any:
    """The run's LrSchedule (workers/lr_schedule.py): the warmup resolved against its step count."""
    from workers.lr_schedule import LrSchedule, resolve_warmup

    warmup = resolve_warmup(train.warmup_steps, train.warmup_ratio, total_steps)
    return LrSchedule(train.lr_scheduler, warmup, total_steps, train.min_lr_ratio)


def steps_line(config: SkrullConfig, total_steps: int, usable_rows: int) -> str:
    """What `train` will run: its step count (derived from train.epochs when train.steps is 0) and LR."""
    train, batch = config.train, config.scheduling.global_batch_size
    source = (f"train.steps={train.steps}" if train.steps else
              f"{train.epochs} epoch(s) x {usable_rows // batch} global batches of {batch} rows")
    schedule = lr_schedule(train, total_steps)
    curve = f"lr {train.lr:g}"
    if schedule.warmup_steps:
        curve += f" after {schedule.warmup_steps} warmup steps"
    if train.lr_scheduler != "constant":
        curve += f", {train.lr_scheduler} decay to {train.lr * train.min_lr_ratio:g} at step {total_steps}"
    return f"train: {total_steps} steps ({source}); {curve}"


def make_trainer(config: SkrullConfig, settings: Any, name: str, monitor: Any,
                 loop: Callable[[dict[str, Any]], None] | None = None, *, embedded: bool = False) -> Any:
    """The TorchTrainer of a run: `loop` (default train_loop_per_worker) gets {"settings": settings}.

    On an `embedded` Ray the workers' process group listens on loopback only (workers/loopback.py).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from app.train.progress import ProgressCallback
    from workers.loopback import LoopbackTorchConfig
    from workers.train_loop import train_loop_per_worker

    res, par = config.resources, config.parallel
    backend = par.backend
    if backend == "auto":
        backend = "nccl" if _use_gpu(config) else "gloo"
    per_worker = {"CPU": res.cpus_per_worker} | ({"GPU": res.gpus_per_worker} if _use_gpu(config) else {})
    per_worker |= res.worker_resources
    keep = CheckpointConfig(num_to_keep=config.train.keep_checkpoints or None)  # None: Ray keeps every one
    workers = par.worker_range if par.elastic else par.worker_range[0]  # (min, max): Ray Train's elastic
    return TorchTrainer(
        loop or train_loop_per_worker,
        train_loop_config={"settings": settings},
        # The world group's timeout; the CP groups get the same one in ParallelGroups.create.
        torch_config=(LoopbackTorchConfig if embedded else TorchConfig)(
            backend=backend, timeout_s=math.ceil(config.train.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=_use_gpu(config),
                                     resources_per_worker=per_worker,
                                     elastic_resize_monitor_interval_s=par.resize_check_s),
        run_config=RunConfig(name=name, **_train_storage(config.run.storage_path),
                             callbacks=[ProgressCallback(monitor)], checkpoint_config=keep,
                             failure_config=FailureConfig(max_failures=config.train.max_failures)),
    )


def _train_storage(storage_path: str) -> dict[str, Any]:
    """RunConfig's storage arguments: a local path as before, or a remote URI's (fs path, filesystem)."""
    storage = Location.of(storage_path)
    if storage.is_local:
        return {"storage_path": storage.uri}
    return {"storage_path": storage.path, "storage_filesystem": storage.filesystem}


def _run_location(config: SkrullConfig, name: str) -> Location:
    """<run.storage_path>/<name> (checked by preflight.run_location before the run started)."""
    return Location.of(config.run.storage_path) / name


@one_line_failures  # a stopped run or a storage error: RunFailed, one line (app/train/failures.py)
def train(config: SkrullConfig, *, progress: bool = True, quiet: bool = False, worker_logs: bool = True,
          out: TextIO | None = None) -> TrainSummary:
    """Run a whole training job; raises ConfigError (or a subclass) on bad input before workers start.

    quiet: everything the libraries print goes to <run_dir>/logs/driver.log (app/train/console.py) and the
    terminal shows only the data summary, the progress bar and warnings; `out` is where those go.
    Ctrl-C and SIGTERM stop the call alike (RunInterrupted). The run's lock (app/rundir/lock.py) is held
    from before its first write to the end: a second call on the same run stops with RunLocked.
    """
    config = _with_bucket_size(config, out)
    name = run_name(config)
    try:
        with sigterm_stops_like_ctrl_c():
            return _train_locked(config, name, progress=progress, quiet=quiet, worker_logs=worker_logs,
                                 out=out)
    except KeyboardInterrupt as err:  # Ray (embedded: every process of it) is already shut down here
        stopped_by = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
        raise RunInterrupted(name, _run_location(config, name), stopped_by) from err


def _with_bucket_size(config: SkrullConfig, out: TextIO | None) -> SkrullConfig:
    """scheduling.bucket_size=auto derived from memory (app/profiling/memory.py), said in one line."""
    from app.profiling.memory import resolve_bucket_size

    resolved, budget = resolve_bucket_size(config)
    if budget.source == "memory":
        print(budget.line(), file=out or sys.stderr, flush=True)
    return resolved


def _train_locked(config: SkrullConfig, name: str, *, progress: bool, quiet: bool, worker_logs: bool,
                  out: TextIO | None) -> TrainSummary:
    """preflight, the run's lock, the resume check and snapshot, then the run under its console."""
    data = preflight(config)
    run = run_storage(config, name)
    existed = run.exists()
    with run_lock(run, out=out, on_lost=_thread.interrupt_main):  # a lost lease stops the call (Ctrl-C)
        set_aside_unloadable_checkpoints(run)  # app/rundir/resume_checkpoints.py: resume only what loads
        resuming = check_resume(config, run, data)
        if write_snapshot(config, run, data, fresh=not resuming):
            print(f"run {name!r} has no complete checkpoint to resume: it starts fresh with this config "
                  f"({CONFIG_SNAPSHOT} replaced)", file=out or sys.stderr, flush=True)
        # A remote run's driver-side files (logs/, tensorboard/, ...) live in a local mirror that is copied
        # into the run's storage at the end (workers/storage.py: pull_mirror, push_mirror).
        run_dir = run.local or pull_mirror(run)
        remote = None if run.is_local else run
        with run_console(run_dir, quiet=quiet, out=out, existed=existed, remote=remote) as terminal:
            return _run(config, name, run_dir, progress=progress, worker_logs=worker_logs, out=terminal)


def _log_example_row(config: SkrullConfig, dataset: Any) -> None:
    """One training row, decoded, loss-bearing text in [[ ]], to stdout: the run's log under a quiet terminal
    (app/train/console.py), so what the model trains on is on record without cluttering the terminal."""
    from app.data.preview import first_usable_example
    from app.data.tokenizer import load_tokenizer

    example = first_usable_example(dataset, load_tokenizer(config.data.tokenizer))
    if example is not None:
        print(f"example training row (loss on [[...]]):\n{example}", flush=True)


@contextlib.contextmanager
def run_console(run_dir: Path, *, quiet: bool, out: TextIO | None, existed: bool,
                remote: Location | None = None) -> Iterator[TextIO]:
    """A driver command's terminal; with `quiet`, what the libraries print goes to <run_dir>/logs/driver.log.

    Yields the stream for the command's own lines. A ConfigError removes `run_dir` unless it `existed`
    (rejected before any worker started: nothing half-written stays behind); any other error except
    Ctrl-C prints where the full log is, after the descriptors are restored. With `remote` (a run on an
    object store), `run_dir` is its local mirror: copied into `remote` at the end, whatever the outcome,
    except after a ConfigError of a new run, which removes `remote` too.
    """
    from app.train.console import captured_output

    log = run_dir / "logs" / "driver.log"
    capture = captured_output(log) if quiet else contextlib.nullcontext(out)
    try:
        with capture as terminal:
            yield terminal or sys.stderr
    except ConfigError:
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
            if remote is not None:
                remote.delete()
                remote = None
        raise
    except KeyboardInterrupt:
        raise
    except BaseException:
        if quiet:  # the descriptors are restored: the terminal gets this line, then the error itself
            where = f"{log} (copied to {remote / 'logs' / 'driver.log'})" if remote is not None else log
            print(f"full log: {where}", file=sys.stderr, flush=True)
        raise
    finally:
        if remote is not None:
            push_mirror(run_dir, remote)


def _run(config: SkrullConfig, name: str, run_dir: Path, *, progress: bool, worker_logs: bool,
         out: TextIO) -> TrainSummary:
    with ray_session(config, worker_logs=worker_logs) as embedded:
        reports, checkpoint, starts = _fit(config, name, run_dir, progress=progress, out=out,
                                           embedded=embedded)
    # A restarted worker group re-runs the steps after its checkpoint: the last report of a step counts.
    history = sorted({h["step"]: h for h in reports}.values(), key=lambda h: h["step"])
    total_time = sum(h["step_s"] for h in history)
    resumed = int(starts[0]["resumed_from_step"]) if starts else int(reports[0]["resumed_from_step"])
    return TrainSummary(
        steps=len(history), samples=sum(int(h["samples"]) for h in history),
        tokens=sum(int(h["tokens"]) for h in history), loss_first=history[0]["loss"],
        loss_last=history[-1]["loss"], tokens_per_s=sum(h["tokens"] for h in history) / max(total_time, 1e-9),
        checkpoint=checkpoint, run_dir=str(_run_location(config, name)), resumed_from_step=resumed or None,
        restarts=max(len(starts) - 1, 0), history=[dict(h) for h in history],
    )


def _fit(config: SkrullConfig, name: str, run_dir: Path, *, progress: bool, out: TextIO,
         embedded: bool) -> tuple[list[dict[str, Any]], str | None, list[dict[str, Any]]]:
    """Tokenize, scan, start the planner and the workers.

    Returns (per-step metrics, final checkpoint path, the worker group's starts).
    """
    import ray

    from app.train.run_monitor import RunMonitor

    data = prepared_data(config, progress=progress, out=out, embedded=embedded, run_dir=run_dir)
    total_steps = _total_steps(config, data.usable_rows)
    if progress:
        print(steps_line(config, total_steps, data.usable_rows), file=out, flush=True)
    planner = planner_actor(config, data.dataset, total_steps, name, eval_dataset=data.eval_dataset)
    monitor = RunMonitor.options(scheduling_strategy=on_this_node()).remote()
    settings = worker_settings(config, planner, monitor, total_steps, _run_location(config, name).uri)
    trainer = make_trainer(config, settings, name, monitor, embedded=embedded)
    result, history = fit_with_progress(config, trainer, monitor, total_steps, progress=progress, out=out,
                                        run_dir=run_dir, run_name=name)
    if not history:
        raise RuntimeError(f"training reported no step; see the log in {run_dir / 'logs'}")
    checkpoint = None
    if result.checkpoint is not None:  # a remote run's checkpoint as a URI (Ray Train gives a bucket path)
        run = _run_location(config, name)
        checkpoint = result.checkpoint.path if run.is_local else str(run / Path(result.checkpoint.path).name)
    return history, checkpoint, ray.get(monitor.starts.remote())


def prepared_dataset(config: SkrullConfig, *, progress: bool, out: TextIO, embedded: bool,
                     planners: int = 1) -> tuple[Any, int]:
    """`prepared_data`'s (dataset, usable training rows), for callers that run no eval (bench train)."""
    data = prepared_data(config, progress=progress, out=out, embedded=embedded, planners=planners)
    return data.dataset, data.usable_rows


@dataclass(frozen=True, slots=True)
class PreparedData:
    dataset: Any
    """The materialized tokenized training dataset (held-out rows included: the planner skips them)."""
    usable_rows: int
    """Usable rows of one epoch that train (data.eval_fraction's held-out rows excluded)."""
    eval_dataset: Any = None
    """data.eval_path's materialized tokenized rows, or None (no eval set, or held out of `dataset`)."""
    eval_rows: int = 0
    """Usable rows of the eval set (0: none)."""


def prepared_data(config: SkrullConfig, *, progress: bool, out: TextIO, embedded: bool,
                  planners: int = 1, run_dir: Path | None = None) -> PreparedData:
    """Check the cluster fits, tokenize once (materialized), scan it, split off the eval set.

    The scan stops the run here, before the planner and the workers start, when more than
    data.max_malformed_fraction of the rows read are malformed (a DataError naming data.path, the fraction
    and the most common reason: app/data/malformed.py).

    `planners`: how many planner actors the run starts (each reserves resources.planner_cpus).
    data.eval_path is tokenized and scanned the same way (its errors name data.eval_path); an eval set
    without a sample is a ConfigError (app/data/split.py). With `run_dir`, the data summary is also
    written to <run_dir>/data_summary.json (app/rundir/files.py; `report` shows it).
    """
    import ray

    from app.data.pipeline import scan_dataset, tokenized_dataset
    from app.data.split import split_counts
    from app.train.preflight import check_cluster_fits, check_epoch_fits

    resources = dataclasses.replace(config.resources, planner_cpus=config.resources.planner_cpus * planners)
    sized = dataclasses.replace(config, resources=resources)
    warning = check_cluster_fits(sized, ray.cluster_resources(), embedded=embedded)
    if warning:
        print(warning, file=out, flush=True)
    dataset = tokenized_dataset(config.data, max_length=config.max_sequence_length,
                                num_cpus=config.resources.data_cpus).materialize()
    scan = scan_dataset(dataset, config.data, max_length=config.max_sequence_length)
    if progress:
        print(scan.summary(), file=out, flush=True)
        _log_example_row(config, dataset)
    eval_dataset, eval_path_rows = _eval_path_dataset(config, progress=progress, out=out)
    counts = split_counts(scan.positions, config.data, eval_path_rows=eval_path_rows)
    if progress and config.data.eval_fraction:
        print(f"eval: {counts.eval_rows} rows held out (data.eval_fraction={config.data.eval_fraction}), "
              f"{counts.train_rows} train", file=out, flush=True)
    check_epoch_fits(config, counts.train_rows)
    if run_dir is not None:
        from app.rundir.files import data_summary, write_data_summary

        summary = data_summary(scan, train_rows=counts.train_rows, eval_rows=counts.eval_rows)
        write_data_summary(run_dir, summary)
    return PreparedData(dataset=dataset, usable_rows=counts.train_rows, eval_dataset=eval_dataset,
                        eval_rows=counts.eval_rows)


def _eval_path_dataset(config: SkrullConfig, *, progress: bool, out: TextIO) -> tuple[Any, int]:
    """(materialized data.eval_path rows, usable rows), or (None, 0) without data.eval_path."""
    from app.data import DataError
    from app.data.pipeline import scan_dataset, tokenized_dataset
    from app.data.split import as_eval_path_error, eval_data_config

    if not config.data.eval_path:
        return None, 0
    data = eval_data_config(config.data)
    try:
        dataset = tokenized_dataset(data, max_length=config.max_sequence_length,
                                    num_cpus=config.resources.data_cpus).materialize()
        scan = scan_dataset(dataset, data, max_length=config.max_sequence_length)
    except DataError as err:
        raise as_eval_path_error(err, config.data) from None
    if progress:
        print(scan.summary().replace("data:", "eval data:", 1), file=out, flush=True)
    return dataset, scan.num_usable


def _stale_profile_check(config: SkrullConfig, run_dir: Path, total_steps: int) -> Any:
    """The run's stale-profile check (app/profiling/stale_check.py); `profile` takes the run's saved
    config."""
    from app.profiling.stale_check import StaleProfileCheck

    return StaleProfileCheck(profile=config.hardware.profile, config=str(run_dir / CONFIG_SNAPSHOT),
                             total_steps=total_steps)


def fit_with_progress(config: SkrullConfig, trainer: Any, monitor: Any, total_steps: int, *, progress: bool,
                      out: TextIO, run_dir: Path | None = None,
                      run_name: str | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """trainer.fit() (Ctrl-C stays the driver's) under a progress bar fed by `monitor`; with `run_dir`,
    every record also goes to <run_dir>/metrics.jsonl and each group start to worker_starts.jsonl
    (app/rundir/files.py), to <run_dir>/tensorboard/ (app/sinks/tensorboard.py), with train.mlflow_uri to
    MLflow (app/sinks/mlflow.py) and with train.wandb_project to W&B (app/sinks/wandb.py), as the run
    `run_name` (default: run_dir's name).

    Returns (Ray Train's result, every reported record in order).
    """
    from app.rundir.files import RunLog
    from app.sinks.mlflow import MlflowLog
    from app.sinks.tensorboard import TensorBoardLog
    from app.sinks.wandb import WandbLog
    from app.train.preflight import snapshot_record
    from app.train.progress import ProgressBar

    # ray.train.report is a barrier of Ray Train's own (not torch's), without a timeout by default: a peer
    # hung between two collectives would hang it. It reads its timeout from this variable, which Ray Train
    # hands to its controller from the driver's environment.
    timeout = {"RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(config.train.collective_timeout_s)}
    log = TensorBoardLog(run_dir) if run_dir is not None else None
    run_log = RunLog(run_dir, total_steps) if run_dir is not None else None
    tracking = None
    if run_dir is not None and config.train.mlflow_uri:
        tracking = MlflowLog(config.train.mlflow_uri, run_dir, run_name or run_dir.name,
                             snapshot_record(config), out=out)
    wandb_log = None
    if run_dir is not None and config.train.wandb_project:
        try:
            wandb_log = WandbLog(config.train.wandb_project, config.train.wandb_entity, run_dir,
                                 run_name or run_dir.name, snapshot_record(config), out=out)
        except ConfigError:
            if tracking is not None:
                tracking.close("FAILED")
            raise
    sinks = tuple(sink.record if isinstance(sink, RunLog) else sink.write
                  for sink in (run_log, log, tracking, wandb_log) if sink is not None)
    # bench train (no run_dir here) judges its counted steps itself, without warm-up (app/bench/summary.py)
    stale_check = (_stale_profile_check(config, run_dir, total_steps),) if run_dir is not None else ()
    status = "FAILED"
    try:
        with ProgressBar(monitor, total_steps, enabled=progress, file=out, sinks=sinks,
                         start_sinks=(run_log.group_started,) if run_log else (),
                         line_sinks=stale_check) as bar, \
                _environment(timeout):
            result = _fit_interruptibly(trainer)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if log is not None:
            log.close()
        if tracking is not None:
            tracking.close(status)
        if wandb_log is not None:
            wandb_log.close(status)
    return result, bar.history


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (a value the user exported wins), then restore."""
    added = {k: v for k, v in variables.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _fit_interruptibly(trainer: Any) -> Any:
    """trainer.fit() on a helper thread, so that Ctrl-C reaches the main thread as KeyboardInterrupt.

    Called on the main thread, Ray Train's fit installs its own SIGINT handler (a graceful abort after which
    fit raises an error and the process exits 1, and the handler stays installed); off the main thread it
    does not, and Ctrl-C stays the driver's: Ray is shut down (every process of an embedded one), the
    newest complete checkpoint stays as it is, and `train` prints the command that resumes the run.
    """
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            outcome["error"] = err

    thread = threading.Thread(target=fit, name="skrull-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)  # a timed join lets the main thread take KeyboardInterrupt
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
