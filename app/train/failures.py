"""A run that could not go on, as one line and exit 1: a divergence, a full disk, a refused write.

Two ways a failure reaches the driver:
- the workers stopped on purpose and said why: the last reported step carries "stopped" (a non-finite step,
  workers/nonfinite.py; a checkpoint that could not be written, workers/train_loop.py). Ray Train saw no
  error, so train.max_failures never restarted the group into the same failure.
- a write into the run's storage raised somewhere (a worker's samples.jsonl, Ray Train's controller, the
  driver's own files): the OSError is found inside Ray's wrappers (workers/storage_errors.py) and named with
  run.storage_path and the free space, instead of a traceback dozens of lines deep.

`python -m app` prints a RunFailed as `skrull <command>: error: <line>` and exits 1; with --quiet the
driver log keeps the whole story (app/train/console.py run_console prints where it is).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from app.config import ConfigError
from workers.storage_errors import find_storage_error, reason_of, storage_message

T = TypeVar("T")


class RunFailed(RuntimeError):
    """The run stopped for the reason in the message (exit 1); its newest complete checkpoint stays."""


def stop_reason(history: list[dict[str, Any]]) -> str | None:
    """The "stopped" message of the last reported step, or None (the run went to its end)."""
    return history[-1].get("stopped") if history else None


def storage_failure(err: BaseException, storage_path: str) -> RunFailed | None:
    """`err` as a RunFailed naming run.storage_path, when a storage write caused it; else None."""
    found = find_storage_error(err)
    if found is None:
        return None
    return RunFailed(storage_message(storage_path, "a write into the run's storage", reason_of(found)))


def one_line_failures(train: Callable[..., T]) -> Callable[..., T]:
    """Wrap `train(config, ...)`: a stopped run or a storage error becomes RunFailed (one line, exit 1)."""

    @functools.wraps(train)
    def wrapped(config: Any, *args: Any, **kwargs: Any) -> T:
        from workers.storage import Location

        storage = str(Location.of(config.run.storage_path))
        try:
            summary = train(config, *args, **kwargs)
        except ConfigError:
            raise  # already one line naming its knob (exit 2)
        except Exception as err:
            failure = storage_failure(err, storage)
            if failure is None:
                raise
            raise failure from err
        reason = stop_reason(getattr(summary, "history", []))
        if reason:
            raise RunFailed(reason)
        return summary

    return wrapped
