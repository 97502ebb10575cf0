"""`train_loop_per_worker`: what every Ray Train worker runs.

    get_context() ─▶ ParallelGroups(dp x cp) ─▶ build_model ─▶ deepspeed.initialize (ZeRO-2, generated JSON)
    for step: fetch payload from the planner ─▶ run_step (micro-batches, DACP attention) ─▶ report

Every rank calls `ray.train.report` once per step (it is a barrier); checkpoints are DeepSpeed checkpoints
that every rank writes into its own temp dir, merged by Ray Train into one checkpoint of the run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scheduling.actor import fetch_payload, planner_ahead_steps
from scheduling.payload import RankPayload
from workers.distributed import ParallelGroups
from workers.step import StepStats, run_step

STATE_FILE = "skrull_state.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings:
    """Everything a worker needs, built by the driver from the config tree."""

    model: dict[str, Any]
    """Keyword arguments of `workers.models.build_model`."""
    deepspeed: dict[str, Any]
    cp_size: int
    total_steps: int
    loss_chunk_tokens: int
    checkpoint_every: int
    run_dir: str
    """<storage_path>/<name>: where samples.jsonl is written (by world rank 0)."""
    planner: Any
    seed: int = 0
    first_step: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _build_engine(settings: WorkerSettings, device: torch.device) -> Any:
    import deepspeed  # lazy: the driver and Ray Data workers never need it

    from workers.models import build_model

    torch.manual_seed(settings.seed)  # identical initial weights on every rank for random-init models
    model = build_model(**settings.model).to(device)
    model.train()  # from_pretrained returns eval mode, which would also silently skip activation recompute
    engine, *_ = deepspeed.initialize(model=model, config=settings.deepspeed,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def _step_metrics(stats: StepStats, payload: RankPayload, groups: ParallelGroups, engine: Any,
                  wait_s: float) -> dict[str, float]:
    """Reduce this step's numbers over all ranks (one all_reduce and one all_gather of scalars)."""
    loss_sum = stats.loss_sum.clone()
    dist.all_reduce(loss_sum, group=groups.world_group)
    compute = torch.tensor([stats.compute_s], dtype=torch.float64, device=loss_sum.device)
    gathered = [torch.zeros_like(compute) for _ in range(groups.dp_size * groups.cp_size)]
    dist.all_gather(gathered, compute, group=groups.world_group)
    times = torch.cat(gathered).cpu()
    step_s = float(times.max()) + wait_s
    grad_norm = engine.get_global_grad_norm()
    return {
        "step": payload.step,
        "epoch": payload.epoch,
        "loss": float(loss_sum) / max(payload.global_label_tokens, 1),
        "tokens": payload.global_tokens,
        "label_tokens": payload.global_label_tokens,
        "tokens_per_s": payload.global_tokens / max(step_s, 1e-9),
        "step_s": step_s,
        "planner_wait_s": wait_s,
        "plan_ms": payload.plan_ms,
        "compute_imbalance": float(times.max() / times.mean().clamp_min(1e-9)),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "micro_batches": len(payload.micro_batches),
        "samples": sum(len(ids) for ids in payload.sample_ids_by_dp_rank),
        "cursor_epoch": payload.cursor.epoch,
        "cursor_rows": payload.cursor.rows,
    }


def _append_samples(run_dir: str, payload: RankPayload) -> None:
    path = Path(run_dir) / "samples.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        for dp_rank, ids in enumerate(payload.sample_ids_by_dp_rank):
            out.write(json.dumps({"step": payload.step, "epoch": payload.epoch, "dp_rank": dp_rank,
                                  "sample_ids": list(ids)}) + "\n")


def _report(metrics: dict[str, float], engine: Any, payload: RankPayload, save: bool) -> None:
    """The one place that calls ray.train.report; with `save`, every rank writes its DeepSpeed shard."""
    import ray.train

    if not save:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="skrull-ckpt-") as tmp:
        tag = f"step{payload.step}"
        state = {"step": payload.step, "epoch": payload.cursor.epoch, "rows": payload.cursor.rows, "tag": tag}
        engine.save_checkpoint(tmp, tag=tag, client_state={"skrull": state})
        if dist.get_rank() == 0:
            Path(tmp, STATE_FILE).write_text(json.dumps(state))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    import ray.train

    settings: WorkerSettings = loop_config["settings"]
    context = ray.train.get_context()
    world_size = context.get_world_size()
    if world_size % settings.cp_size:
        raise ValueError(f"{world_size} workers are not divisible by parallel.cp_size={settings.cp_size}")
    groups = ParallelGroups.create(world_size // settings.cp_size, settings.cp_size)
    device = _device()
    engine = _build_engine(settings, device)
    last = settings.first_step + settings.total_steps - 1
    for step in range(settings.first_step, last + 1):
        waited = time.perf_counter()
        payload = fetch_payload(settings.planner, step, groups.dp_rank, groups.cp_rank)
        wait_s = time.perf_counter() - waited
        stats = run_step(engine, payload, groups, device=device,
                         loss_chunk_tokens=settings.loss_chunk_tokens)
        metrics = _step_metrics(stats, payload, groups, engine, wait_s)
        if context.get_world_rank() == 0:  # Ray Train keeps rank 0's metrics; one actor call per step
            metrics["planner_ahead_steps"] = planner_ahead_steps(settings.planner, step)
            _append_samples(settings.run_dir, payload)
        every = settings.checkpoint_every
        _report(metrics, engine, payload, save=step == last or bool(every and step % every == 0))
