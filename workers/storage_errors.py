"""A storage error (disk full, quota, permission) as one line naming run.storage_path and the free space.

Writes into a run's storage happen on the workers (checkpoints, samples.jsonl), in Ray Train's controller
(checkpoint_manager_snapshot.json) and on the driver (metrics.jsonl, logs, ...). Wherever one fails, the
error reaches the driver wrapped in Ray's exceptions (WorkerGroupError.worker_failures, ControllerError,
chained causes); `find_storage_error` digs the OSError out and `storage_message` says what to do.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from workers.storage import Location

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS})
"""No space, over quota, file too large, no permission, read-only filesystem."""


def storage_path_of(run_dir: str) -> str:
    """run.storage_path of a run directory <storage_path>/<name> (secrets redacted, workers/storage.py)."""
    run = Location.of(run_dir)
    if run.is_local:
        return str(Path(run.uri).parent)
    parts = urlsplit(run.uri)
    parent = Location(urlunsplit(parts._replace(path=parts.path.rstrip("/").rsplit("/", 1)[0])))
    return str(parent)


def free_space(where: str) -> str:
    """"<n> MiB free" on the filesystem holding the local path `where` (its nearest existing ancestor),
    or a note that an object store has no such number."""
    location = Location.of(where)
    if not location.is_local:
        return "free space unknown (an object store: check its quota)"
    path = Path(location.uri)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:.1f} MiB free"


def is_storage_error(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


def find_storage_error(err: BaseException | None, depth: int = 0) -> OSError | None:
    """The storage OSError in `err`, its causes, or the worker/controller failures Ray Train wraps."""
    if err is None or depth > 8:
        return None
    if is_storage_error(err):
        return err  # type: ignore[return-value]
    context = None if err.__suppress_context__ else err.__context__  # `raise ... from None` hid it
    inner: list[BaseException | None] = [err.__cause__, context, getattr(err, "_base_exc", None),
                                         getattr(err, "controller_failure", None)]
    inner += list(getattr(err, "worker_failures", {}).values())
    inner.append(getattr(err, "cause", None))  # ray.exceptions.RayTaskError
    for candidate in inner:
        if isinstance(candidate, BaseException):
            found = find_storage_error(candidate, depth + 1)
            if found is not None:
                return found
    return None


def storage_message(storage_path: str, what: str, reason: str) -> str:
    """The one line: which write failed under run.storage_path, why, the free space, and what to do."""
    return (f"run.storage_path={storage_path}: {what} failed ({reason}; {free_space(storage_path)}). "
            "Free space there (or point run.storage_path at a larger filesystem) and rerun the same command "
            "to resume from the newest complete checkpoint")


def reason_of(err: OSError) -> str:
    """`err` in a few words: the errno's text (pyarrow's own is "Error writing bytes to file. Detail: ...")
    and the file, else its message."""
    text = os.strerror(err.errno) if err.errno else (err.strerror or str(err)).split(". Detail:")[0]
    return f"{text}: {err.filename}" if err.filename else text
