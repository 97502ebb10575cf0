"""Ray Data settings of the driver process, applied before Ray Data is imported (`python -m app`).

    RAY_DATA_METADATA_PREFETCH_ON_THREAD=0   the streaming executor reads a finished block's metadata
                                             inline instead of on a fetch thread

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
