"""Ctrl-C and SIGTERM on the `train` driver: both stop the call the same way (Ray shut down, the run's lock
released, the newest complete checkpoint kept) and end in RunInterrupted, which `train` turns into the
resume command and exit code 128 + the signal."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workers.storage import Location


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM on the driver: Ray is shut down; a re-run resumes from the newest complete
    checkpoint. `signal_number`: the signal that stopped it (SIGINT or SIGTERM)."""

    def __init__(self, name: str, run_dir: Path | Location, signal_number: int = signal.SIGINT) -> None:
        super().__init__(name)
        self.name = name
        self.run_dir = run_dir
        self.signal_number = signal_number


class Terminated(KeyboardInterrupt):
    """SIGTERM on the driver (what `ray job stop` and cluster schedulers send), raised like Ctrl-C's
    KeyboardInterrupt so that it takes the same way out: Ray shut down, the run lock released."""


def raise_terminated(signum: int, frame: Any) -> None:
    """The SIGTERM handler while sigterm_stops_like_ctrl_c is in effect."""
    raise Terminated()


@contextlib.contextmanager
def sigterm_stops_like_ctrl_c() -> Iterator[None]:
    """For the duration, SIGTERM raises Terminated on the main thread (elsewhere: nothing changes).

    ray.init replaces the process's SIGTERM handler with one that calls sys.exit(15) (ray/_private/
    worker.py, `init`): ray_session puts this one back after it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
