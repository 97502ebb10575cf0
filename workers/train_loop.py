"""`train_loop_per_worker`: what every Ray Train worker runs.

    get_context() ─▶ ParallelGroups (dp x cp groups, attention runtime)
        ─▶ planner restart from the checkpoint's cursor
        ─▶ build_engine (ZeRO-2) + load the checkpoint (universal on a new world size)
    for step: PlannerClient.fetch ─▶ run_step (micro-batches, DACP attention) ─▶ metrics window
              every train.log_every steps (and on checkpoint steps): reduce the window ─▶ report
              every train.eval_every steps and after the last: + eval_loss (workers/eval_step.py), reported

`ray.train.report` is a barrier, so every rank reports on the same steps. Checkpoints are DeepSpeed
checkpoints that every rank writes into its own temp dir with a manifest of its files and copies into the
run's storage itself (workers/checkpoint_files.py); only when every rank's copy succeeded is the checkpoint
reported to Ray Train (`checkpoint_upload_mode=NO_UPLOAD`: already in place), which records it as the
newest. Layout and resume on another world size: workers/checkpoints.py.

Stopping without an error: a non-finite step (workers/nonfinite.py) or a checkpoint that could not be
written (disk full, quota, permission) ends the run on every rank alike: world rank 0 reports the window
with a "stopped" message (the driver turns it into exit 1 with that line, app/train/failures.py) and every
rank returns. Raising instead would make Ray Train restart the group (train.max_failures) into the same
divergence or the same full disk, and print a traceback per worker.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from scheduling.actor import Fetched, PlannerClient
from scheduling.payload import Cursor, RankPayload
from workers import lr_schedule
from workers.allocator import use_expandable_segments
from workers.checkpoint_files import save_checkpoint
from workers.checkpoints import (
    CheckpointState,
    converting_to_universal,
    cut_samples,
    resume_point,
    universal_dir,
)
from workers.distributed import ParallelGroups
from workers.engine import (
    DeepSpeedConfig,
    ZeroGroups,
    build_engine,
    engine_phases,
    for_world_size,
    phases_text,
)
from workers.eval_step import EvalSet, is_eval_step
from workers.hf_export import export_complete, export_engine
from workers.lr_schedule import LrSchedule
from workers.metrics import MetricsWindow
from workers.models import ModelSpec
from workers.nonfinite import NonFiniteGuard, NonFinitePolicy, knob_values
from workers.step import StepStats, run_step, synchronize
from workers.storage import Location
from workers.warmup import warm_up
from workers.zero_step import place_step_counters

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from ray.train import Checkpoint


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings:
    """Everything a worker needs, built by the driver from the config tree."""

    model: ModelSpec
    deepspeed: DeepSpeedConfig
    cp_size: int
    total_steps: int
    loss_chunk_tokens: int
    checkpoint_every: int
    log_every: int
    run_dir: str
    """<storage_path>/<name> (a local path or a URI, workers/storage.py): where world rank 0 writes
    samples.jsonl."""
    planner: Any
    """The PlannerActor handle."""
    monitor: Any = None
    """The driver's RunMonitor handle (told of every start of the worker group), or None."""
    seed: int = 0
    collective_timeout_s: float = 1800.0
    """train.collective_timeout_s: the CP and ZeRO groups' timeout (the world's comes from TorchConfig)."""
    planner_timeout_s: float | None = None
    """scheduling.planner_timeout_s: longest wait for one step's payload."""
    eval_every: int = 0
    """train.eval_every: the eval loss after every this many steps and after the last (0: never)."""
    nonfinite: NonFinitePolicy = NonFinitePolicy()
    cp_degrees: tuple[int, ...] | None = None
    """scheduling.cp_degrees, resolved: the CP subgroups the worker builds (docs/design.md §13); None: all."""
    """train.nonfinite and train.max_skipped_steps (workers/nonfinite.py)."""
    lr_schedule: LrSchedule = LrSchedule()
    """train.lr_scheduler, warmup and min_lr_ratio over total_steps (workers/lr_schedule.py)."""
    calibration: bool = False
    """scheduling.calibration=online: world rank 0 sends each log window's laps to the planner."""
    warmup_tokens: int = 0
    """Tokens of the untimed warm-up micro-batch before the first step (workers/warmup.py): BucketSize C;
    0: none."""
    overlap_comm: str = "auto"
    """train.overlap_comm (workers/engine.py for_world_size decides `auto` on the worker)."""
    one_rank_zero1: bool = True
    """train.one_rank_zero1 (workers/engine.py for_world_size: ZeRO-2 as stage 1 on a single worker)."""
    export_on_finish: bool = False
    """train.export_on_finish: after the last step, the trained weights (a LoRA run's adapter) streamed into
    <run_dir>/.hf-export/ (workers/hf_export.py), which the driver publishes as <run_dir>/hf/."""


def _append_samples(run_dir: str, payload: RankPayload) -> None:
    """One samples.jsonl line per DP rank of this step, through the run's filesystem (workers/storage.py).

    A local append that fails (a full disk) is cut back off, so no torn line stays behind (an object store
    rewrites the object whole or not at all)."""
    path = Location.of(run_dir) / "samples.jsonl"
    size = path.local.stat().st_size if path.local is not None and path.local.exists() else 0
    try:
        path.append_lines([json.dumps({"step": payload.step, "epoch": payload.epoch, "dp_rank": dp_rank,
                                       "sample_ids": list(ids)})
                           for dp_rank, ids in enumerate(payload.sample_ids_by_dp_rank)])
    except OSError:
        if path.local is not None:
            with contextlib.suppress(OSError):
                os.truncate(path.local, size)
        raise


def _report(window: list[dict[str, Any]], engine: DeepSpeedEngine, payload: RankPayload,
            groups: ParallelGroups, save: bool, run_dir: str,
            calibration: dict[str, Any] | None = None) -> str | None:
    """The one place that calls ray.train.report; with `save`, every rank writes its DeepSpeed shard.

    The reported metrics are the window's last step, plus every step of the window under "history"
    (the driver's progress bar and summary read that). Returns why the run stops (a checkpoint that could
    not be written; its step's metrics then carry the reason as "stopped"), or None. A checkpoint keeps
    `calibration`, the planner's online fit when the step was fetched (a resume plans with it).
    A step that saves carries `checkpoint_s`: the wall seconds of save_checkpoint (DeepSpeed's shard
    written, hashed and moved into the run's storage, every rank's outcome gathered); the report that
    registers it with Ray Train comes after, and world rank 0 prints both in one line.
    """
    import ray.train
    from ray.train import CheckpointUploadMode

    saved = None
    if save:
        state = CheckpointState(step=payload.step, epoch=payload.cursor.epoch, rows=payload.cursor.rows,
                                tag=f"step{payload.step}", world_size=groups.world_size,
                                dp_size=groups.dp_size, cp_size=groups.cp_size, spares=groups.spares,
                                calibration=calibration, zero_stage=engine.zero_optimization_stage())
        started = time.perf_counter()
        saved = save_checkpoint(engine, state, groups.world_group, run_dir)
        window[-1]["checkpoint_s"] = time.perf_counter() - started
        if saved.failure is not None:
            window[-1]["stopped"] = saved.failure
    metrics = {**window[-1], "history": window}
    reported = time.perf_counter()
    if saved is None or saved.checkpoint is None:
        ray.train.report(metrics)
    else:
        ray.train.report(metrics, checkpoint=saved.checkpoint, checkpoint_dir_name=saved.name,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    if saved is not None and dist.get_rank() == 0:
        print(f"[skrull] checkpoint of step {payload.step} saved in {window[-1]['checkpoint_s']:.1f} s, "
              f"reported to Ray Train in {time.perf_counter() - reported:.1f} s", flush=True)
    return saved.failure if saved is not None else None


def _start_group(settings: WorkerSettings, groups: ParallelGroups, resume: CheckpointState | None,
                 session: str) -> None:
    """World rank 0: log the shape, cut samples.jsonl back to the checkpoint, restart the planner from it."""
    announce_group(settings, groups, resume, session)
    cut_samples(settings.run_dir, resume.step if resume else 0)
    restart_planner(settings.planner, groups, resume, session, timeout_s=settings.planner_timeout_s)


def announce_group(settings: WorkerSettings, groups: ParallelGroups, resume: CheckpointState | None,
                   session: str) -> None:
    """World rank 0: log this start's shape and tell the driver's monitor (which counts the starts)."""
    import ray

    resumed = resume.step if resume else 0
    if resume is None:
        print(f"[skrull] worker group {groups.shape}: fresh start", flush=True)
    else:
        change = f"{resume.shape} -> {groups.shape}" if resume.shape != groups.shape else groups.shape
        print(f"[skrull] worker group {change}: resuming after step {resumed}", flush=True)
    if groups.spares:
        print(f"[skrull] {groups.world_size} workers are not a multiple of parallel.cp_size="
              f"{groups.cp_size}: {groups.trained_ranks} train, {groups.spares} spare rank(s) only hold "
              "optimizer state (zero gradient)", flush=True)
    if settings.monitor is not None:
        ray.get(settings.monitor.group_started.remote(session, resumed))


def restart_planner(planner: Any, groups: ParallelGroups, resume: CheckpointState | None, session: str, *,
                    timeout_s: float | None) -> None:
    """World rank 0: `planner` plans from the checkpoint's cursor (or the start) for this group's shape."""
    import ray

    resumed = resume.step if resume else 0
    start = Cursor(epoch=resume.epoch, rows=resume.rows) if resume else Cursor(epoch=0, rows=0)
    calibration = resume.calibration if resume else None  # the profile the run had fitted by then
    restart = planner.restart.remote(session, start, resumed + 1, groups.dp_size, groups.spares,
                                     calibration=calibration)
    ray.get(restart, timeout=timeout_s)


def parallel_groups(settings: WorkerSettings, device: torch.device) -> ParallelGroups:
    """This worker's DP x CP groups with the run's collective timeout (collective: every rank alike)."""
    return ParallelGroups.create(settings.cp_size, device=device,
                                 attention_backend=settings.model.attention_backend,
                                 timeout=timedelta(seconds=settings.collective_timeout_s),
                                 degrees=settings.cp_degrees)


def zero_groups(settings: WorkerSettings) -> ZeroGroups:
    """ZeRO-2's groups with the run's collective timeout; create once per worker, share with every engine."""
    return ZeroGroups.create(timedelta(seconds=settings.collective_timeout_s))


def _engine(settings: WorkerSettings, device: torch.device, groups: ParallelGroups,
            checkpoint: Checkpoint | None, resume: CheckpointState | None,
            local_rank: int) -> DeepSpeedEngine:
    """Build the engine, load the checkpoint into it (another world size goes through universal) and put
    the learning-rate schedule at the step after it."""
    engine = _loaded_engine(settings, device, groups, checkpoint, resume, local_rank)
    lr_schedule.position(engine.lr_scheduler, resume.step if resume else 0)
    return engine


def _loaded_engine(settings: WorkerSettings, device: torch.device, groups: ParallelGroups,
                   checkpoint: Checkpoint | None, resume: CheckpointState | None,
                   local_rank: int) -> DeepSpeedEngine:
    zero = zero_groups(settings)
    build = functools.partial(build_engine, settings.model, device=device, seed=settings.seed, groups=zero,
                              lr_schedule=settings.lr_schedule, overlap_comm=settings.overlap_comm,
                              one_rank_zero1=settings.one_rank_zero1)
    if resume is None:
        return build(settings.deepspeed)
    if resume.world_size == groups.world_size and _saved_stage(settings, resume) == _stage(settings, groups):
        engine = build(settings.deepspeed)
        with checkpoint.as_directory() as directory:
            # A LoRA checkpoint holds only the adapter: the built base weights stay (non-strict load).
            engine.load_checkpoint(directory, tag=resume.tag,
                                   load_module_strict=not settings.model.frozen_base)
        place_step_counters(engine)
        return engine
    target = universal_dir(checkpoint.path, resume)
    universal: DeepSpeedConfig = {**settings.deepspeed, "checkpoint": {"load_universal": True}}
    if local_rank == 0:  # one conversion per node, beside this rank's engine build; all wait at the barrier
        with checkpoint.as_directory() as directory, converting_to_universal(directory, resume, target):
            engine = build(universal)
    else:
        engine = build(universal)
    dist.barrier(group=groups.world_group)
    engine.load_checkpoint(str(target), tag=f"{resume.tag}_universal")
    place_step_counters(engine)  # the universal loader restores fused AdamW's counters on the CPU
    dist.barrier(group=groups.world_group)
    if local_rank == 0:
        shutil.rmtree(target, ignore_errors=True)
    return engine


def _stage(settings: WorkerSettings, groups: ParallelGroups) -> int:
    """The ZeRO stage DeepSpeed runs for this worker group (workers/engine.py for_world_size)."""
    ds = for_world_size(settings.deepspeed, settings.overlap_comm, groups.world_size, settings.one_rank_zero1)
    return ds["zero_optimization"]["stage"]


def _saved_stage(settings: WorkerSettings, resume: CheckpointState) -> int:
    """The ZeRO stage that wrote the checkpoint (the config's, for one written before it was recorded)."""
    configured = settings.deepspeed["zero_optimization"]["stage"]
    return resume.zero_stage if resume.zero_stage is not None else configured


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One start of the worker group: resume from the newest checkpoint (if any), then train to the end.

    Ray Train calls this again after a worker failure (train.max_failures), on an elastic resize, or on a
    re-run of the same run name: each start re-plans the remaining steps from the checkpoint's data cursor
    for this start's DP size, cuts samples.jsonl back to the checkpoint, and loads model, optimizer and LR
    schedule from it (through a universal checkpoint when the world size changed).
    """
    import ray.train
    import ray.train.torch

    settings: WorkerSettings = loop_config["settings"]
    use_expandable_segments()  # before this process's first CUDA allocation
    context = ray.train.get_context()
    device = ray.train.torch.get_device()
    groups = parallel_groups(settings, device)
    checkpoint = ray.train.get_checkpoint()
    resume = resume_point(checkpoint)
    if resume is not None and resume.step >= settings.total_steps:
        # A group started after the final checkpoint (an elastic resize or a restart in the moment between
        # the last report and the end of the run): the run is complete, there is nothing to plan or train;
        # only the export may be missing (the previous group stopped during it).
        if settings.export_on_finish and not _exported(settings, groups, resume.step):
            engine = _engine(settings, device, groups, checkpoint, resume, context.get_local_rank())
            export_engine(engine, settings.model, settings.run_dir, step=resume.step,
                          group=groups.world_group)
        return
    session = uuid.uuid4().hex  # only world rank 0's is used: it names this start of the worker group
    is_rank0 = context.get_world_rank() == 0
    if is_rank0:
        _start_group(settings, groups, resume, session)
    dist.barrier(group=groups.world_group)  # nobody fetches before the planner restarted
    started = time.perf_counter()
    engine = _engine(settings, device, groups, checkpoint, resume, context.get_local_rank())
    _train(settings, engine, groups, device, resumed=resume.step if resume else 0, session=session,
           is_rank0=is_rank0, engine_s=time.perf_counter() - started)


def _exported(settings: WorkerSettings, groups: ParallelGroups, step: int) -> bool:
    """World rank 0's reading of whether the export of `step` is complete, the same on every rank."""
    found = [export_complete(settings.run_dir, step) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0, group=groups.world_group)
    return bool(found[0])


def _train(settings: WorkerSettings, engine: DeepSpeedEngine, groups: ParallelGroups, device: torch.device,
           *, resumed: int, session: str, is_rank0: bool, engine_s: float = 0.0) -> None:
    """Steps resumed+1 .. total_steps: fetch, step, log window, report (with a checkpoint when due); stops
    early, on every rank alike, at a non-finite step or a checkpoint that could not be written. The first
    step this start reports carries its start-up: `engine_s` (the engine built, the checkpoint loaded), its
    split `engine_phases_s` (build_engine's phases and "other": workers/engine.py engine_phases) and
    `warmup_s` (the warm-up micro-batch, to the device's end of it). With train.export_on_finish, world
    rank 0 prints the seconds of the export after the last step."""
    planner = PlannerClient(settings.planner, timeout_s=settings.planner_timeout_s)
    window = MetricsWindow(spare=groups.is_spare)
    guard = NonFiniteGuard(settings.nonfinite, knob_values(settings.deepspeed), last_checkpoint_step=resumed)
    shape = {"world_size": groups.world_size, "dp_size": groups.dp_size, "cp_size": groups.cp_size,
             "spare_workers": groups.spares, "resumed_from_step": resumed, "session": session}
    last = settings.total_steps
    eval_set = EvalSet.fetch(settings.planner, groups, timeout_s=settings.planner_timeout_s) \
        if settings.eval_every else None
    observe = planner.observe if is_rank0 and settings.calibration else None
    phases = engine_phases(engine, engine_s)
    startup = {"engine_s": engine_s, "engine_phases_s": phases,
               "warmup_s": _timed_warm_up(settings, engine, groups, device)}
    if is_rank0:
        print(f"[skrull] engine ready in {engine_s:.1f} s ({phases_text(phases)}), warm-up micro-batch "
              f"{startup['warmup_s']:.1f} s", flush=True)

    def flushed() -> list[dict[str, Any]]:
        metrics = [m | shape for m in window.flush(groups.world_group)]
        if metrics:  # the start-up once, on this start's first reported step
            metrics[0] |= startup
            startup.clear()
        return metrics

    for step in range(resumed + 1, last + 1):
        fetched, _ = fetch_and_step(settings, planner, engine, groups, device, window, step, guard=guard)
        if guard.stop is not None:  # its samples were never trained on: samples.jsonl does not get them
            metrics = flushed()
            metrics[-1]["stopped"] = guard.stop
            _report(metrics, engine, fetched.payload, groups, save=False, run_dir=settings.run_dir)
            return
        if is_rank0:
            _append_samples(settings.run_dir, fetched.payload)
        save = step == last or bool(settings.checkpoint_every and step % settings.checkpoint_every == 0)
        # An eval step forces a report (every rank decides alike, so Ray Train's report barrier holds):
        # its eval_loss goes into that step's metrics, the last of the window.
        evaluate = eval_set is not None and is_eval_step(step, last, settings.eval_every)
        if save or evaluate or step % settings.log_every == 0:
            metrics = flushed()
            for warning in guard.review(metrics):  # the device step's flags, judged now (nonfinite.py)
                if is_rank0:
                    print(warning, flush=True)
            if guard.stop is not None:  # a deferred bad step: stop without a checkpoint of what came after
                metrics[-1]["stopped"] = guard.stop
                _report(metrics, engine, fetched.payload, groups, save=False, run_dir=settings.run_dir)
                return
            if observe is not None:
                observe(session, metrics, first_step=resumed + 1)
            if evaluate:
                metrics[-1]["eval_loss"] = eval_set.loss(engine, groups, device=device,
                                                         loss_chunk_tokens=settings.loss_chunk_tokens)
            if _report(metrics, engine, fetched.payload, groups, save=save, run_dir=settings.run_dir,
                       calibration=fetched.calibration):
                return
            if save:
                guard.last_checkpoint_step = step
    if settings.export_on_finish:  # every step trained and the last one checkpointed
        started = time.perf_counter()
        export_engine(engine, settings.model, settings.run_dir, step=last, group=groups.world_group)
        if is_rank0:
            print(f"[skrull] export streamed in {time.perf_counter() - started:.1f} s", flush=True)


def _timed_warm_up(settings: WorkerSettings, engine: DeepSpeedEngine, groups: ParallelGroups,
                   device: torch.device) -> float:
    """warm_up's seconds, to the device's end of it (one sync before step 1, outside any step)."""
    started = time.perf_counter()
    warm_up(engine, groups, device, tokens=settings.warmup_tokens,
            loss_chunk_tokens=settings.loss_chunk_tokens)
    synchronize(device)
    return time.perf_counter() - started


def fetch_and_step(settings: WorkerSettings, planner: PlannerClient, engine: DeepSpeedEngine,
                   groups: ParallelGroups, device: torch.device, window: MetricsWindow, step: int,
                   guard: NonFiniteGuard | None = None, sync: bool = False) -> tuple[Fetched, StepStats]:
    """One step: wait for this rank's payload, run it on `engine`, add the step to the metrics window.

    The window keeps the two timers every report is made of: the planner wait (Fetched.wait_s) and the
    compute time of the step on this rank (StepStats.compute_s, read on the log step). A spare rank asks
    as dp_rank -1. With a `guard`, a step DeepSpeed did not apply (non-finite, a host bool) is judged here
    (warned about, or `guard.stop`); the device step's flag is judged on the log step (`guard.review`).
    `sync`: wait for the device at the end of the step (callers that time single steps).
    """
    dp_rank, cp_rank = (-1, 0) if groups.is_spare else (groups.dp_rank, groups.cp_rank)
    fetched = planner.fetch(step, dp_rank, cp_rank)
    lr = float(engine.get_lr()[0])  # this step's rate, from the optimizer (a host float: no device sync)
    stats = run_step(engine, fetched.payload, groups, device=device,
                     loss_chunk_tokens=settings.loss_chunk_tokens, sync=sync)
    nonfinite = None
    if stats.applied is False:  # DeepSpeed's own step skipped it (the device step leaves a tensor)
        lr_schedule.skip(engine.lr_scheduler)
        if guard is not None:
            nonfinite = guard.after_step(step, False, stats.loss_sum, groups.world_group)
            if guard.stop is None and dist.get_rank() == 0:
                print(guard.warning(step, nonfinite), flush=True)
    elif stats.applied is True and guard is not None:
        guard.after_step(step, True, stats.loss_sum, groups.world_group)
    window.add(fetched, stats.loss_sum, engine.get_global_grad_norm(), stats.laps, applied=stats.applied,
               nonfinite=nonfinite, skipped_steps=guard.skipped if guard is not None else 0, lr=lr)
    return fetched, stats
