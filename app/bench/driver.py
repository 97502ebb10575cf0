"""The `bench train` driver: several policies train the same global batches in one Ray session, interleaved.

    preflight (no Ray) ─▶ ray.init ─▶ tokenized_dataset(...).materialize() (once, shared by every planner)
        ─▶ one PlannerActor per policy (same stream, same scheduling.seed: step n is the same global batch)
        ─▶ TorchTrainer(bench_loop_per_worker).fit(): one worker group, one engine per policy, per step
           A B C D, B C D A, C D A B ... (the order rotates each step) after one warm-up step per policy
           (workers/bench_loop.py)
        ─▶ BenchRun: every (policy, step) record, the wall time, the machine's load

Everything but the worker loop is `train`'s own driver code (app/train/: cluster, components, dataset,
fit): the same Ray session and resource reservations (every planner actor reserves
resources.planner_cpus, 0 by default, so four planners fit on 2 cores beside the two workers and Ray
Data), the same worker settings and trainer, the same progress bar and quiet console (the libraries'
output goes to <run_dir>/logs/driver.log).

A bench run lives in a fresh directory <run.storage_path>/bench-train-<timestamp>-<hex>/ (run.name is
ignored: a bench never resumes, and must not write into a training run); it keeps the log, the config
snapshot and the results (bench_train.json). No checkpoint is written.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from app.config import ConfigError, SkrullConfig
from app.rundir.location import run_directory
from app.rundir.snapshot import write_snapshot
from app.train.preflight import preflight

if TYPE_CHECKING:
    from app.data.resolved import ResolvedData

WARMUP_STEPS = 1
"""Steps every policy runs first and the summary leaves out (engine and allocator warm-up, first plans)."""


@dataclass(frozen=True)
class BenchRun:
    """What one `bench train` measured; app/commands/bench_train.py summarizes it."""

    config: SkrullConfig
    policies: tuple[str, ...]
    steps: int
    """Counted steps per policy (after `warmup_steps` uncounted ones)."""
    warmup_steps: int
    """Leading uncounted steps: WARMUP_STEPS, plus scheduling.calibration_window with online calibration
    (the planners fit the profile, and skrull explores its candidates, before the counted steps)."""
    records: list[dict[str, Any]]
    """One per (step, policy), in the order they ran, warm-up included (keys: workers/bench_loop.py)."""
    wall_s: float
    """Wall time of the whole bench on the driver: Ray's start, tokenizing, engines, every step."""
    run_dir: str
    machine: dict[str, Any]
    distinct_global_batches: int
    """Global batches of distinct samples one epoch of the data holds (usable rows // global batch size):
    steps beyond it revisit samples (the planner starts another epoch)."""


def check_policies(policies: Sequence[str]) -> tuple[str, ...]:
    """The policies to compare, each a registered one and none twice; else ConfigError naming --policies."""
    from scheduling import POLICIES

    names = tuple(p.strip() for p in policies)
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        what = f"unknown policy {', '.join(map(repr, unknown))}" if unknown else "no policy given"
        raise ConfigError(f"--policies: {what}; valid names (comma-separated): {', '.join(POLICIES)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--policies: {','.join(names)} names a policy twice")
    return names


def check_bench_config(config: SkrullConfig, steps: int) -> None:
    """What `bench train` needs beyond a valid run config (ConfigError naming the knob)."""
    if steps < 1:
        raise ConfigError(f"--steps={steps}: need at least one counted step")
    if config.parallel.elastic:
        raise ConfigError(f"parallel.num_workers={list(config.parallel.worker_range)}: bench train needs a "
                          "fixed worker count (a resize would restart the group mid-comparison)")


def machine_info() -> dict[str, Any]:
    """Facts to read the timings by: cores, the load average (what `uptime` shows) and the platform."""
    return {"cpus": os.cpu_count(), "load_avg_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "python": platform.python_version(),
            "started": datetime.now().isoformat(timespec="seconds")}


def bench_train(config: SkrullConfig, policies: Sequence[str], steps: int, *, progress: bool = True,
                quiet: bool = False, worker_logs: bool = True, out: TextIO | None = None) -> BenchRun:
    """Train `steps` (+ warm-up) global batches with every policy, interleaved; ConfigError on bad input.

    quiet: the libraries' output goes to <run_dir>/logs/driver.log; on a ConfigError the run directory is
    removed again, so bad input leaves nothing behind.
    """
    from app.train.console import run_console

    names = check_policies(policies)
    check_bench_config(config, steps)
    data = preflight(config)
    name = f"bench-train-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(4)}"
    run_dir = run_directory(config, name)
    machine = machine_info()
    started = time.perf_counter()
    write_snapshot(config, run_dir, template=data.chat_template_text)
    with run_console(run_dir, quiet=quiet, out=out, existed=False) as terminal:
        records, distinct = _run(config, data, names, steps, name, run_dir, progress=progress,
                                 worker_logs=worker_logs, out=terminal)
    machine["load_avg_1_5_15_min_end"] = [round(x, 2) for x in os.getloadavg()]
    return BenchRun(config=config, policies=names, steps=steps, warmup_steps=uncounted_steps(config),
                    records=records, wall_s=time.perf_counter() - started, run_dir=str(run_dir),
                    machine=machine, distinct_global_batches=distinct)


def uncounted_steps(config: SkrullConfig) -> int:
    """BenchRun.warmup_steps of a bench of `config`."""
    sched = config.scheduling
    return WARMUP_STEPS + (sched.calibration_window if sched.calibration == "online" else 0)


def _with_policy(config: SkrullConfig, policy: str) -> SkrullConfig:
    return dataclasses.replace(config, scheduling=dataclasses.replace(config.scheduling, policy=policy))


def _run(config: SkrullConfig, data: ResolvedData, policies: tuple[str, ...], steps: int, name: str,
         run_dir: Path, *, progress: bool, worker_logs: bool,
         out: TextIO) -> tuple[list[dict[str, Any]], int]:
    """Ray session, data, one planner per policy, the worker group; returns every (step, policy) record and
    BenchRun.distinct_global_batches."""
    from app.train.cluster import on_this_node, ray_session
    from app.train.components import make_trainer, planner_actor, worker_settings
    from app.train.dataset import prepared_data
    from app.train.fit import fit_with_progress
    from app.train.run_monitor import RunMonitor
    from scheduling.actor import PlannerData
    from workers.bench_loop import BenchSettings, bench_loop_per_worker

    warmup = uncounted_steps(config)
    total = warmup + steps
    # A restarted group would re-run steps on engines that already took them: fail instead of retrying.
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, max_failures=0))
    with ray_session(config, worker_logs=worker_logs) as embedded:
        prepared = prepared_data(config, data, progress=progress, out=out, embedded=embedded,
                                 planners=len(policies))
        planner_data = PlannerData.put(prepared.dataset)  # one copy for every policy's planner
        planners = tuple((p, planner_actor(_with_policy(config, p), planner_data, total, f"{name}-{p}",
                                           tokenizer=data.tokenizer)) for p in policies)
        monitor = RunMonitor.options(scheduling_strategy=on_this_node()).remote()
        worker = worker_settings(config, None, monitor, total, str(run_dir), tokenizer=data.tokenizer)
        settings = BenchSettings(worker=worker, planners=planners, warmup_steps=warmup)
        trainer = make_trainer(config, settings, name, monitor, loop=bench_loop_per_worker, embedded=embedded)
        _, records = fit_with_progress(config, trainer, monitor, total, progress=progress, out=out)
    if len(records) != total * len(policies):
        raise RuntimeError(f"the workers reported {len(records)} of {total * len(policies)} (step, policy) "
                           f"records; see the log in {run_dir / 'logs'}")
    return records, prepared.usable_rows // config.scheduling.global_batch_size
