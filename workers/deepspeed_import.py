"""`import deepspeed` the way every process of a run does it (lazily: the driver and Ray Data never need it).

Its own module so that what builds models (workers/sharded.py) and what builds engines (workers/engine.py)
import DeepSpeed alike without importing each other.
"""

from __future__ import annotations

import sys
from typing import Any


def import_deepspeed() -> Any:
    """`import deepspeed`, without letting it import mlflow; lazy: the driver and Ray Data never need it.

    DeepSpeed's autotuner, which a run never starts, imports mlflow at import time when it is installed
    (the `mlflow` extra): mlflow 3 brings its GenAI stack, ~1.5-3 s of CPU in every train worker's start
    (measured with `python -X importtime`, 2026-11-25). While deepspeed imports, `import mlflow` raises
    ImportError (a None entry in sys.modules), which DeepSpeed catches; the entry is removed afterwards,
    so mlflow imports normally later in the process.

    Every call also keeps DeepSpeed from JIT-building its CPU shm comm op (skip_cpu_shm_comm_op), so that
    each process that builds an engine, whichever way it imported deepspeed, skips it.
    """
    if "deepspeed" not in sys.modules:
        blocked = "mlflow" not in sys.modules
        if blocked:
            sys.modules["mlflow"] = None  # type: ignore[assignment]
        try:
            import deepspeed  # noqa: F401
        finally:
            if blocked and sys.modules.get("mlflow", 0) is None:
                del sys.modules["mlflow"]
    skip_cpu_shm_comm_op()
    return sys.modules["deepspeed"]


def skip_cpu_shm_comm_op() -> None:
    """Keep DeepSpeed's CPU accelerator from JIT-building its shared-memory all-reduce op.

    When DeepSpeed's comm backend starts on the CPU accelerator it builds `deepspeed_shm_comm` with g++
    (40-70 s with both cores of a 2-core machine, once per environment and cache: the first step of every
    new CPU setup waited for it, CI included; measured 2026-11-25) for `inference_all_reduce` alone, which
    training never calls: ZeRO's collectives go through torch.distributed. DeepSpeed builds it only if
    `deepspeed.ops.__compatible_ops__` marks it compatible (deepspeed/comm/torch.py `build_shm_op`), and
    that dict is DeepSpeed's per-process record of which ops may be built, so the op is marked off there.
    CUDA's accelerator has no such op: a GPU worker is unaffected.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
