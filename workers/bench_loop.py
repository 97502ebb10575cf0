"""`bench_loop_per_worker`: several scheduling policies train the same global batches in one worker group.

    ParallelGroups, ZeroGroups (once) ─▶ one DeepSpeed engine per policy, each from the same seed
    for step in 1 .. warmup + steps:
        for policy in that step's order:  fetch_and_step(that policy's planner, that policy's engine)
            (the order rotates by one each step: A B C D, B C D A, C D A B, ...)
        flush each policy's metrics window + all_gather the per-rank timings   (collectives, not timed)
        ray.train.report(the round's records) ─▶ the driver's monitor (progress bar, results)

Why one process tree and interleaving: the policies then share the machine's state (other load, CPU
frequency, caches, the object store) step by step, so drift over the run hits every policy alike instead
of whichever ran last. Every engine starts from the same weights and every planner reads the same
materialized stream with the same seed, so step n of every policy is the same global batch and, the math
of a step being the same under every plan, the policies' losses agree up to summation order.

Why the order rotates: the first step of a round is not like the others. It runs right after the round's
report, while the driver handles it and the planners plan ahead, which on a small machine shares the
same cores. A fixed order would charge that to the first policy named on every step; rotating spreads it
over all of them (each policy runs first on every len(policies)-th step).

What is measured per (policy, step), with the timers `train` reports (workers/metrics.py):
    step_s, planner_wait_s, compute_imbalance, loss, tokens   MetricsWindow.flush, exactly as in `train`
    rank_wait_s       per rank: seconds waiting for the planner and the object store (Fetched.wait_s)
    rank_compute_s    per rank: wall seconds of forward + backward + optimizer step (StepStats.compute_s);
                      this includes time blocked in collectives (the ring, ZeRO's reduce-scatter), so the
                      ranks of a CP group end close together whatever their share of the work
    rank_cpu_s        per rank: CPU seconds of the worker process (all threads) over the fetch and the
                      step: the work the rank did, without the time it sat blocked waiting for a peer
    rank_predicted_busy_s, predicted_step_s   the cost model's times of the same plan (RankPayload)
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from scheduling.actor import Fetched, PlannerClient
from workers.distributed import ParallelGroups
from workers.engine import build_engine
from workers.metrics import MetricsWindow
from workers.train_loop import (
    WorkerSettings,
    announce_group,
    fetch_and_step,
    parallel_groups,
    restart_planner,
    zero_groups,
)

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

T = TypeVar("T")

RANK_TIMINGS = ("rank_wait_s", "rank_compute_s", "rank_cpu_s", "rank_predicted_busy_s")
"""Per-rank values of each record, in the order of the gathered tensor's last axis."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSettings:
    """What every worker of `bench train` needs, built by the driver (app/bench/driver.py)."""

    worker: WorkerSettings
    """Model, DeepSpeed JSON, timeouts; total_steps counts the warm-up steps; its `planner` is unused."""
    planners: tuple[tuple[str, Any], ...]
    """(policy, PlannerActor handle), in the order every step runs them."""
    warmup_steps: int = 1
    """Leading steps of every policy that run but are marked warmup (the driver leaves them out)."""


@dataclass
class _Policy:
    """One policy's engine, planner client, metrics window and this round's per-rank readings."""

    name: str
    engine: DeepSpeedEngine
    planner: PlannerClient
    window: MetricsWindow
    fetched: Fetched | None = None
    readings: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)


def bench_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Build one engine per policy (same seed, same ZeroGroups), then run the interleaved steps."""
    import ray.train
    import ray.train.torch

    settings: BenchSettings = loop_config["settings"]
    base = settings.worker
    device = ray.train.torch.get_device()
    groups = parallel_groups(base, device)
    session = uuid.uuid4().hex
    if ray.train.get_context().get_world_rank() == 0:
        announce_group(base, groups, None, session)
        for _, planner in settings.planners:
            restart_planner(planner, groups, None, session, timeout_s=base.planner_timeout_s)
    dist.barrier(group=groups.world_group)  # nobody fetches before every planner planned for this group
    policies = _build_policies(settings, groups, device)
    for step in range(1, base.total_steps + 1):
        for policy in rotated(policies, step):
            _timed_step(base, policy, groups, device, step)
        records = _round_records(policies, groups, device, warmup=step <= settings.warmup_steps,
                                 session=session, observe=base.calibration and dist.get_rank() == 0)
        ray.train.report({**records[-1], "history": records})


def rotated(items: list[T], step: int) -> list[T]:
    """The order of step `step` (1-based): `items` rotated left by step - 1 (the same on every rank)."""
    shift = (step - 1) % len(items)
    return items[shift:] + items[:shift]


def _build_policies(settings: BenchSettings, groups: ParallelGroups, device: torch.device) -> list[_Policy]:
    """One engine per policy, all from the same seed (identical initial weights) and the same ZeroGroups."""
    base = settings.worker
    zero = zero_groups(base)  # created once: every engine reduces over the same groups
    return [_Policy(name=name, engine=build_engine(base.model, base.deepspeed, device, base.seed, zero,
                                                   overlap_comm=base.overlap_comm,
                                                   one_rank_zero1=base.one_rank_zero1),
                    planner=PlannerClient(planner, timeout_s=base.planner_timeout_s),
                    window=MetricsWindow(spare=groups.is_spare))
            for name, planner in settings.planners]


def _timed_step(base: WorkerSettings, policy: _Policy, groups: ParallelGroups, device: torch.device,
                step: int) -> None:
    """`train`'s step on this policy's engine; also reads the process CPU time around it."""
    cpu_started = time.process_time()
    fetched, stats = fetch_and_step(base, policy.planner, policy.engine, groups, device, policy.window, step,
                                    sync=True)
    policy.fetched = fetched
    policy.readings = (fetched.wait_s, stats.compute_s, time.process_time() - cpu_started,
                       fetched.payload.predicted_busy_s)


def _round_records(policies: list[_Policy], groups: ParallelGroups, device: torch.device, *, warmup: bool,
                   session: str, observe: bool = False) -> list[dict[str, Any]]:
    """One record per policy for this step (collective: every rank calls it after the same step); with
    `observe` (world rank 0, online calibration) each policy's laps go to its own planner, which fits
    from its own steps only, as a run of that policy would."""
    # On the device: NCCL gathers device tensors only.
    mine = torch.tensor([p.readings for p in policies], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(groups.world_group))]
    dist.all_gather(gathered, mine, group=groups.world_group)
    per_rank = torch.stack(gathered).cpu()  # [world ranks, policies, RANK_TIMINGS]
    records = []
    for index, policy in enumerate(policies):
        (metrics,) = policy.window.flush(groups.world_group)
        metrics.pop("deferred", None)  # bench train reports the flag as it is, it judges no divergence
        payload = policy.fetched.payload
        if observe:
            policy.planner.observe(session, [metrics], first_step=1)
        timings = {key: per_rank[:, index, k].tolist() for k, key in enumerate(RANK_TIMINGS)}
        records.append({
            **metrics, **timings, "policy": policy.name, "warmup": warmup, "session": session,
            "predicted_step_s": payload.predicted_step_s,
            "predicted_step_s_initial": payload.predicted_step_s_initial,
            "calibration_version": (policy.fetched.calibration or {}).get("version", 0),
            "sample_ids": sorted(i for ids in payload.sample_ids_by_dp_rank for i in ids),
            "torch_threads": torch.get_num_threads(),
        })
    return records
