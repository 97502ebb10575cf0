"""`train_loop_per_worker`: what every Ray Train worker runs.

    get_context() ─▶ ParallelGroups (dp x cp mesh, attention runtime) ─▶ build_engine (ZeRO-2, generated JSON)
    for step: PlannerClient.fetch ─▶ run_step (micro-batches, DACP attention) ─▶ metrics window
              every train.log_every steps (and on checkpoint steps): reduce the window ─▶ report

`ray.train.report` is a barrier, so every rank reports on the same steps. Checkpoints are DeepSpeed
checkpoints that every rank writes into its own temp dir, merged by Ray Train into one checkpoint of the run.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scheduling.actor import PlannerClient
from scheduling.payload import Cursor, RankPayload
from workers.distributed import ParallelGroups
from workers.engine import DeepSpeedConfig, build_engine
from workers.metrics import MetricsWindow
from workers.models import ModelSpec
from workers.step import run_step

STATE_FILE = "skrull_state.json"


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
    """<storage_path>/<name>: where samples.jsonl is written (by world rank 0)."""
    planner: Any
    """The PlannerActor handle."""
    seed: int = 0


def _append_samples(run_dir: str, payload: RankPayload) -> None:
    path = Path(run_dir) / "samples.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        for dp_rank, ids in enumerate(payload.sample_ids_by_dp_rank):
            out.write(json.dumps({"step": payload.step, "epoch": payload.epoch, "dp_rank": dp_rank,
                                  "sample_ids": list(ids)}) + "\n")


def _report(window: list[dict[str, float]], engine: Any, payload: RankPayload, save: bool) -> None:
    """The one place that calls ray.train.report; with `save`, every rank writes its DeepSpeed shard.

    The reported metrics are the window's last step, plus every step of the window under "history"
    (the driver's progress bar and summary read that).
    """
    import ray.train

    metrics = {**window[-1], "history": window}
    if not save:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="skrull-ckpt-") as tmp:
        tag = f"step{payload.step}"
        state = {"step": payload.step, "epoch": payload.cursor.epoch, "rows": payload.cursor.rows, "tag": tag,
                 "dp_size": len(payload.sample_ids_by_dp_rank)}
        engine.save_checkpoint(tmp, tag=tag, client_state={"skrull": state})
        if dist.get_rank() == 0:
            Path(tmp, STATE_FILE).write_text(json.dumps(state))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _resume_point(checkpoint: Any) -> dict[str, Any] | None:
    """The skrull_state.json of Ray Train's newest complete checkpoint of this run, or None (fresh run)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return json.loads(Path(directory, STATE_FILE).read_text())


def _cut_samples(run_dir: str, last_step: int) -> None:
    """Keep only the samples.jsonl lines of steps the resumed model has trained (atomic replace)."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One start of the worker group: resume from the newest checkpoint (if any), then train to the end.

    Ray Train calls this again after a worker failure (train.max_failures) or on a re-run of the same run
    name: each start re-plans the remaining steps from the checkpoint's data cursor, cuts samples.jsonl
    back to the checkpoint, and loads model, optimizer and LR schedule from it.
    """
    import ray.train
    import ray.train.torch

    settings: WorkerSettings = loop_config["settings"]
    context = ray.train.get_context()
    world_size, is_rank0 = context.get_world_size(), context.get_world_rank() == 0
    if world_size % settings.cp_size:
        raise ValueError(f"{world_size} workers are not divisible by parallel.cp_size={settings.cp_size}")
    device = ray.train.torch.get_device()
    groups = ParallelGroups.create(world_size // settings.cp_size, settings.cp_size, device=device,
                                   attention_backend=settings.model.attention_backend)
    checkpoint = ray.train.get_checkpoint()
    resume = _resume_point(checkpoint)
    resumed = resume["step"] if resume else 0
    session = uuid.uuid4().hex  # only world rank 0's is used: it names this start of the worker group
    if is_rank0:
        _cut_samples(settings.run_dir, resumed)
        start = Cursor(epoch=resume["epoch"], rows=resume["rows"]) if resume else Cursor(epoch=0, rows=0)
        ray.get(settings.planner.restart.remote(session, start, resumed + 1, groups.dp_size))
    dist.barrier(group=groups.world_group)  # nobody fetches before the planner restarted
    engine = build_engine(settings.model, settings.deepspeed, device, settings.seed)
    if resume:
        with checkpoint.as_directory() as directory:
            engine.load_checkpoint(directory, tag=resume["tag"])
    planner = PlannerClient(settings.planner)
    window = MetricsWindow()
    last = settings.total_steps
    for step in range(resumed + 1, last + 1):
        fetched = planner.fetch(step, groups.dp_rank, groups.cp_rank)
        stats = run_step(engine, fetched.payload, groups, device=device,
                         loss_chunk_tokens=settings.loss_chunk_tokens)
        window.add(fetched, stats.loss_sum, engine.get_global_grad_norm(), stats.compute_s)
        if is_rank0:
            _append_samples(settings.run_dir, fetched.payload)
        save = step == last or bool(settings.checkpoint_every and step % settings.checkpoint_every == 0)
        if save or step % settings.log_every == 0:
            metrics = [m | {"resumed_from_step": resumed, "session": session}
                       for m in window.flush(groups.world_group)]
            _report(metrics, engine, fetched.payload, save=save)
