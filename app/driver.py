"""The `train` driver: preflight, Ray, data scan, planner actor, Ray Train workers, summary.

    preflight (no Ray) ─▶ ray.init (embedded, or RAY_ADDRESS) ─▶ scan_dataset (too long? empty?)
        ─▶ PlannerActor(tokenized_dataset) ─▶ TorchTrainer(train_loop_per_worker).fit() ─▶ TrainSummary

Resources on a small machine: Ray Data's file-listing task needs one whole CPU even when every worker holds
a fraction, so an embedded Ray declares more logical CPUs than cores (cores + 2 by default; STACK_NOTES).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from app.config import ConfigError, SkrullConfig
from app.deepspeed_config import deepspeed_config
from app.model_args import model_build_kwargs
from app.preflight import preflight, run_directory, run_name


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
    history: list[dict[str, float]]
    """Every step's reported metrics (loss, tokens_per_s, step_s, planner_wait_s, ...), in step order."""

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]

    def to_json_dict(self) -> dict[str, Any]:
        """The public `train --json` summary: the totals, without the per-step history."""
        result = asdict(self)
        del result["history"]
        return result


def start_ray(config: SkrullConfig, *, worker_logs: bool = True) -> None:
    """Connect to RAY_ADDRESS's cluster, or start an embedded one sized for Ray Data + planner + workers."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=worker_logs)
        return
    num_cpus = config.resources.num_cpus or (os.cpu_count() or 1) + 2
    # The dashboard's state API is what Ray Train's placement-group cleaner polls; without it, it logs a
    # warning every few seconds.
    ray.init(num_cpus=num_cpus, log_to_driver=worker_logs)


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


def _planner(config: SkrullConfig, total_steps: int) -> Any:
    from app.data.pipeline import tokenized_dataset
    from app.hardware import cost_model_from_config
    from scheduling.actor import PlannerActor, PlannerSettings

    sched, par = config.scheduling, config.parallel
    settings = PlannerSettings(
        policy=sched.policy, dp_size=par.dp_size, cp_size=par.cp_size, bucket_size=sched.bucket_size,
        global_batch_size=sched.global_batch_size, total_steps=total_steps, prefetch=sched.prefetch,
        seed=sched.seed, static_cp_micro_batch=sched.static_cp_micro_batch,
    )
    actor = PlannerActor.options(num_cpus=config.resources.planner_cpus)
    return actor.remote(tokenized_dataset(config), settings, cost_model_from_config(config))


def _worker_settings(config: SkrullConfig, planner: Any, total_steps: int, run_dir: str) -> Any:
    from workers.train_loop import WorkerSettings

    return WorkerSettings(
        model=model_build_kwargs(config), deepspeed=deepspeed_config(config, on_gpu=_use_gpu(config)),
        cp_size=config.parallel.cp_size, total_steps=total_steps,
        loss_chunk_tokens=config.train.loss_chunk_tokens, checkpoint_every=config.train.checkpoint_every,
        run_dir=run_dir, planner=planner, seed=config.train.seed,
    )


def _trainer(config: SkrullConfig, settings: Any, name: str, monitor: Any) -> Any:
    from ray.train import LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from app.monitor import ProgressCallback
    from workers.train_loop import train_loop_per_worker

    res = config.resources
    backend = config.parallel.backend
    if backend == "auto":
        backend = "nccl" if _use_gpu(config) else "gloo"
    per_worker = {"CPU": res.cpus_per_worker} | ({"GPU": res.gpus_per_worker} if _use_gpu(config) else {})
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"settings": settings},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=config.parallel.num_workers, use_gpu=_use_gpu(config),
                                     resources_per_worker=per_worker),
        run_config=RunConfig(name=name, storage_path=str(os.path.abspath(config.run.storage_path)),
                             callbacks=[ProgressCallback(monitor)],
                             # Ray Train logs every report at INFO; our progress bar already shows them.
                             logging_config=LoggingConfig(log_level="WARNING")),
    )


def train(config: SkrullConfig, *, progress: bool = True, worker_logs: bool = True) -> TrainSummary:
    """Run a whole training job; raises ConfigError (or a subclass) on bad input before workers start."""
    preflight(config)
    name = run_name(config)
    run_dir = run_directory(config, name)
    start_ray(config, worker_logs=worker_logs)

    from app.data.pipeline import scan_dataset
    from app.monitor import ProgressBar, RunMonitor

    scan = scan_dataset(config)
    if progress:
        print(scan.summary(), flush=True)
    total_steps = _total_steps(config, len(scan.lengths))
    planner = _planner(config, total_steps)
    monitor = RunMonitor.remote()
    settings = _worker_settings(config, planner, total_steps, str(run_dir))
    trainer = _trainer(config, settings, name, monitor)
    with ProgressBar(monitor, total_steps, enabled=progress) as bar:
        result = trainer.fit()
    history = bar.history
    if not history:
        raise RuntimeError("training reported no step; see the worker logs above")
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    total_time = sum(h["step_s"] for h in history)
    return TrainSummary(
        steps=len(history), samples=sum(int(h["samples"]) for h in history),
        tokens=sum(int(h["tokens"]) for h in history), loss_first=history[0]["loss"],
        loss_last=history[-1]["loss"], tokens_per_s=sum(h["tokens"] for h in history) / max(total_time, 1e-9),
        checkpoint=checkpoint, run_dir=str(run_dir),
        history=[dict(h) for h in history],
    )
