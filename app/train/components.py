"""The pieces of a run on Ray, built from the config tree: the planner actor, the workers' settings, the
TorchTrainer, the step count and its learning-rate schedule. `train` (app/train/driver.py), `bench train`
(app/bench/driver.py) and `profile` assemble their runs from them.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.config import ConfigError, SkrullConfig, TrainConfig
from app.train.cluster import on_this_node
from workers.storage import Location

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.train.torch import TorchTrainer

    from app.data.tokenizer import TextTokenizer
    from scheduling.actor import PlannerData
    from workers.lr_schedule import LrSchedule
    from workers.train_loop import WorkerSettings


def use_gpu(config: SkrullConfig) -> bool:
    """The workers reserve GPUs (resources.gpus_per_worker > 0)."""
    return config.resources.gpus_per_worker > 0


def total_steps_of(config: SkrullConfig, usable_rows: int) -> int:
    """train.steps, or train.epochs passes of whole global batches over the usable rows."""
    if config.train.steps:
        return config.train.steps
    steps = usable_rows // config.scheduling.global_batch_size * config.train.epochs
    if steps == 0:
        raise ConfigError(
            f"{usable_rows} usable rows make no full global batch of scheduling.global_batch_size="
            f"{config.scheduling.global_batch_size}; lower it or add data"
        )
    return steps


def planner_actor(config: SkrullConfig, data: PlannerData, total_steps: int, name: str, *,
                  tokenizer: TextTokenizer | None = None) -> ActorHandle:
    """A PlannerActor for config.scheduling.policy over `data` (the materialized datasets by reference:
    PlannerData.put, which the caller holds for as long as the run may restart the actor), on the
    driver's node.

    The planner skips the rows data.eval_fraction holds out and, with data.shuffle (file and hub data),
    visits each epoch in a permutation seeded by (data.seed, epoch) (scheduling/order.py); data.eval_path's
    materialized rows (`data.eval`) are the eval set instead of the held-out rows, planned in stream
    order. `tokenizer`: the run's loaded one (ResolvedData.tokenizer), which sizes a tiny preset's
    vocabulary for the cost model without loading it again.
    """
    from app.data.sources import mix_spec
    from app.profiling.hardware import cost_model
    from scheduling.actor import PlannerActor, PlannerSettings

    sched, par = config.scheduling, config.parallel
    settings = PlannerSettings(
        policy=sched.policy, dp_size=par.dp_size, cp_size=par.cp_size, bucket_size=sched.bucket_size,
        global_batch_size=sched.global_batch_size, total_steps=total_steps, prefetch=sched.prefetch,
        seed=sched.seed, static_cp_micro_batch=sched.static_cp_micro_batch,
        eval_fraction=config.data.eval_fraction, data_seed=config.data.seed,
        shuffle=config.data.shuffle and not config.data.synthetic,  # synthetic: random already
        cp_degrees=config.cp_degrees, calibration=sched.calibration == "online",
        calibration_window=sched.calibration_window, chunkflow_keep=sched.chunkflow_keep,
        mix=mix_spec(config.data), source_ids=tuple(s.source_id for s in config.data.sources),
    )
    # Ray restarts a dead planner actor (a fresh one, planning from the run's start); the workers' own
    # restart then moves it to the checkpoint's cursor. Calls are never retried: a payload call answered
    # by a planner that restarted from the wrong place would hand out the wrong data.
    actor = PlannerActor.options(num_cpus=config.resources.planner_cpus, max_restarts=-1, max_task_retries=0,
                                 scheduling_strategy=on_this_node(),
                                 name=f"skrull-planner-{name}-{secrets.token_hex(3)}")  # for operators
    return actor.remote(data, settings, cost_model(config, tokenizer=tokenizer))


def worker_settings(config: SkrullConfig, planner: ActorHandle | None, monitor: ActorHandle, total_steps: int,
                    run_dir: str, *, tokenizer: TextTokenizer | None = None) -> WorkerSettings:
    """The workers' WorkerSettings (model, DeepSpeed JSON, timeouts) from the config tree; `tokenizer` as
    for planner_actor (a tiny preset's vocabulary)."""
    from app.model.deepspeed_config import deepspeed_config
    from app.model.spec import model_spec
    from app.profiling.hardware import model_dims
    from workers.nonfinite import NonFinitePolicy
    from workers.train_loop import WorkerSettings

    train = config.train
    return WorkerSettings(
        model=model_spec(config.model, train, tokenizer=tokenizer or config.data.tokenizer),
        deepspeed=deepspeed_config(train, dtype=config.model.dtype, on_gpu=use_gpu(config),
                                   hidden_size=model_dims(config.model, tokenizer or config.data.tokenizer)
                                   .hidden_size),
        cp_size=config.parallel.cp_size, cp_degrees=config.cp_degrees, total_steps=total_steps,
        loss_chunk_tokens=train.loss_chunk_tokens,
        checkpoint_every=train.checkpoint_every, log_every=train.log_every, run_dir=run_dir,
        planner=planner, monitor=monitor, seed=train.seed, collective_timeout_s=train.collective_timeout_s,
        planner_timeout_s=config.scheduling.planner_timeout_s, eval_every=train.eval_every,
        nonfinite=NonFinitePolicy(train.nonfinite, train.max_skipped_steps),
        lr_schedule=lr_schedule(train, total_steps),
        calibration=config.scheduling.calibration == "online",
        warmup_tokens=config.scheduling.bucket_size, overlap_comm=train.overlap_comm,
        one_rank_zero1=train.one_rank_zero1,
        export_on_finish=train.export_on_finish,
    )


def lr_schedule(train: TrainConfig, total_steps: int) -> LrSchedule:
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


def make_trainer(config: SkrullConfig, settings: Any, name: str, monitor: ActorHandle,
                 loop: Callable[[dict[str, Any]], None] | None = None, *,
                 embedded: bool = False) -> TorchTrainer:
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
        backend = "nccl" if use_gpu(config) else "gloo"
    per_worker = {"CPU": res.cpus_per_worker} | ({"GPU": res.gpus_per_worker} if use_gpu(config) else {})
    per_worker |= res.worker_resources
    keep = CheckpointConfig(num_to_keep=config.train.keep_checkpoints or None)  # None: Ray keeps every one
    workers = par.worker_range if par.elastic else par.worker_range[0]  # (min, max): Ray Train's elastic
    return TorchTrainer(
        loop or train_loop_per_worker,
        train_loop_config={"settings": settings},
        # The world group's timeout; the CP groups get the same one in ParallelGroups.create.
        torch_config=(LoopbackTorchConfig if embedded else TorchConfig)(
            backend=backend, timeout_s=math.ceil(config.train.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu(config),
                                     resources_per_worker=per_worker,
                                     elastic_resize_monitor_interval_s=par.resize_check_s),
        run_config=RunConfig(name=name, **_train_storage(config.run.storage_path),
                             callbacks=[ProgressCallback(monitor)], checkpoint_config=keep,
                             failure_config=FailureConfig(max_failures=config.train.max_failures)),
    )


def _train_storage(storage_path: str) -> dict[str, Any]:
    """RunConfig's storage arguments: a local path, or a remote URI's (its path, its filesystem)."""
    storage = Location.of(storage_path)
    if storage.is_local:
        return {"storage_path": storage.uri}
    return {"storage_path": storage.path, "storage_filesystem": storage.filesystem}


def run_location_of(config: SkrullConfig, name: str) -> Location:
    """<run.storage_path>/<name> (checked by app/rundir/location.py before the run started)."""
    return Location.of(config.run.storage_path) / name
