"""Ray Data settings of the driver process, applied before Ray Data is imported (`python -m app`), and one
applied when a pipeline is built (apply_executor_settings).

    RAY_DATA_METADATA_PREFETCH_ON_THREAD=0   the streaming executor reads a finished block's metadata
                                             inline instead of on a fetch thread
    resource budget re-read every 0.1 s      not every 1 s: a run starts all its tokenize tasks at once

Why: the fetch thread polls with `ray.wait(<every pending block>, timeout=0.1)`, so a tokenize task's
finished block reaches the scheduling loop up to 0.1 s late and the next block's task starts that much
later. On a 2-core machine with two tokenize tasks this left the workers idle ~2.7 s in a ~13 s run
(a per-batch timer inside the tasks, 20,000 chats in 17 blocks, 2026-11-27); inline, ~1.2 s. The
metadata is a few hundred bytes per block (one local `ray.get`), so the loop does not wait on it.
Ray Data reads the knob once, when its executor module is imported: it is set here, at the process's
start, unless the environment already sets it (the user's choice wins).
"""

from __future__ import annotations

import os

RAY_DATA_DRIVER_DEFAULTS: dict[str, str] = {"RAY_DATA_METADATA_PREFETCH_ON_THREAD": "0"}


def apply_ray_data_defaults(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Set each of RAY_DATA_DRIVER_DEFAULTS the environment does not set."""
    for name, value in RAY_DATA_DRIVER_DEFAULTS.items():
        environ.setdefault(name, value)


BUDGET_REFRESH_S = 0.1
"""How often Ray Data's executor re-reads the CPUs its run may use (Ray's own: every 1 s)."""


def apply_executor_settings() -> None:
    """Let a Ray Data run start every tokenize task at once, not one task for its first second.

    Ray Data's executor learns the cluster resources it may use from its autoscaling coordinator (an
    actor, asked asynchronously) and re-reads them every `ResourceManager.GLOBAL_LIMITS_UPDATE_INTERVAL_S`
    (1 s): before the first answer its budget is zero and only its liveness rule runs one task at a time.
    Measured on 2 cores (2026-11-28, a map of 8 blocks, 0.6 s each, 2 tasks): the second task started
    ~1.05 s after the first, the run took 3.5 s instead of 2.8 s; with the budget re-read every 0.1 s both
    started within 0.2 s. That second is fixed per run, so it is most of the gap on short rows (20,000
    ~150-token chats tokenize in ~2.5 s on 2 cores). Ray Data has no public knob for it: the class
    attribute is set here, on the driver (where the executor runs), when Ray Data has it; the cost is one
    asynchronous actor call per 0.1 s per running dataset. tests/test_data_sources.py checks that Ray
    still has the attribute.
    """
    from ray.data._internal.execution import resource_manager

    manager = getattr(resource_manager, "ResourceManager", None)
    if manager is not None and hasattr(manager, "GLOBAL_LIMITS_UPDATE_INTERVAL_S"):
        interval = manager.GLOBAL_LIMITS_UPDATE_INTERVAL_S
        manager.GLOBAL_LIMITS_UPDATE_INTERVAL_S = min(interval, BUDGET_REFRESH_S)
