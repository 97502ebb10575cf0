"""A quiet terminal for `train`: everything the libraries print goes to the run's log file.

Ray (its own start-up lines, Ray Data's progress logs, every worker's and actor's output forwarded to the
driver), DeepSpeed's start-up chatter, Ray Train's per-report lines and library deprecation warnings all
reach this process's file descriptors 1 and 2, or those of the processes it starts, which inherit them.
So the capture happens at the descriptor level: fds 1 and 2 point at `<run_dir>/logs/driver.log` for the
duration of the run, and the command writes its own lines (progress bar, data summary, warnings that need
the user's action) to a duplicate of the original stderr. An exception restores the descriptors before it
propagates, so the error reaches the terminal whole (the caller adds where the full log is).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def captured_output(log_path: Path) -> Iterator[TextIO]:
    """Route fds 1 and 2 to `log_path` (appending); yield a line-buffered stream to the real stderr."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "a", buffering=1) as log, os.fdopen(os.dup(saved[1]), "w", buffering=1) as terminal:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield terminal
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
