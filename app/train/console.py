"""A quiet terminal for `train`: everything the libraries print goes to the run's log file.

Ray (its own start-up lines, Ray Data's progress logs, every worker's and actor's output forwarded to the
driver), DeepSpeed's start-up chatter, Ray Train's per-report lines and library deprecation warnings all
reach this process's file descriptors 1 and 2, or those of the processes it starts, which inherit them.
So the capture happens at the descriptor level: fds 1 and 2 point at `<run_dir>/logs/driver.log` for the
duration of the run, and the command writes its own lines (progress bar, data summary, warnings that need
the user's action) to a duplicate of the original stderr. An exception restores the descriptors before it
propagates, so the error reaches the terminal whole (the caller adds where the full log is).

`run_console` is a driver command's terminal around that capture: it also removes a new run's directory
after a ConfigError (nothing half-written stays) and copies a remote run's local mirror to its store.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from app.config import ConfigError
from workers.storage import Location, push_mirror


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


@contextlib.contextmanager
def run_console(run_dir: Path, *, quiet: bool, out: TextIO | None, existed: bool,
                remote: Location | None = None) -> Iterator[TextIO]:
    """A driver command's terminal; with `quiet`, what the libraries print goes to <run_dir>/logs/driver.log.

    Yields the stream for the command's own lines. A ConfigError removes `run_dir` unless it `existed`
    (rejected before any worker started: nothing half-written stays behind); any other error except
    Ctrl-C prints where the full log is, after the descriptors are restored. With `remote` (a run on an
    object store), `run_dir` is its local mirror: copied into `remote` at the end, whatever the outcome,
    except after a ConfigError of a new run, which removes `remote` too.
    """
    log = run_dir / "logs" / "driver.log"
    capture = captured_output(log) if quiet else contextlib.nullcontext(out)
    try:
        with capture as terminal:
            yield terminal or sys.stderr
    except ConfigError:
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
            if remote is not None:
                remote.delete()
                remote = None
        raise
    except KeyboardInterrupt:
        raise
    except BaseException:
        if quiet:  # the descriptors are restored: the terminal gets this line, then the error itself
            where = f"{log} (copied to {remote / 'logs' / 'driver.log'})" if remote is not None else log
            print(f"full log: {where}", file=sys.stderr, flush=True)
        raise
    finally:
        if remote is not None:
            push_mirror(run_dir, remote)
