"""Where a run lives: its name, <run.storage_path>/<name> (a local directory or an object-store URI), checked
writable before anything of the run is read or written, and the set-aside and resume checks that decide
whether the run starts fresh or resumes (app/rundir/resume_checkpoints.py, app/rundir/snapshot.py).

Secrets: every message naming run.storage_path shows the URI with its secrets redacted (workers/storage.py
redact_uri / redact_text).
"""

from __future__ import annotations

import secrets
from datetime import datetime
from pathlib import Path

from app.config import ConfigError, SkrullConfig
from app.rundir.resume_checkpoints import set_aside_unloadable_checkpoints
from app.rundir.snapshot import check_resume
from workers.storage import Location, is_remote, redact_text, redact_uri


def run_name(config: SkrullConfig) -> str:
    """run.name, or a fresh unique name when it is empty: the timestamp plus 32 random bits, so runs that a
    sweep starts within one second do not collide."""
    return config.run.name or f"skrull-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(4)}"


def run_storage(config: SkrullConfig, name: str) -> Location:
    """<storage_path>/<name> (a local directory or an object-store URI, workers/storage.py), after checking
    that storage_path is usable and writable; nothing of the run is read or written yet."""
    storage = _storage_location(config.run.storage_path)
    _check_writable(storage)
    return storage / name


def run_location(config: SkrullConfig, name: str) -> Location:
    """run_storage, set_aside_unloadable_checkpoints, then check_resume: a new run, or an existing one to
    resume (same math, from a checkpoint that loads)."""
    run = run_storage(config, name)
    set_aside_unloadable_checkpoints(run)  # app/rundir/resume_checkpoints.py: resume only what loads
    check_resume(config, run)
    return run


def run_directory(config: SkrullConfig, name: str) -> Path:
    """run_location for commands that need a local run directory (`bench train`)."""
    if is_remote(config.run.storage_path):
        raise ConfigError(f"run.storage_path={redact_uri(config.run.storage_path)!r}: this command writes a "
                          "local run directory; point run.storage_path at a local or mounted directory")
    local = run_location(config, name).local
    assert local is not None
    return local


_REMOTE_HINT = ("check that the bucket exists, the endpoint (endpoint_override=HOST:PORT&scheme=http in the "
                "URI, or AWS_ENDPOINT_URL) and the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE; AWS_DEFAULT_REGION)")


def _storage_location(storage_path: str) -> Location:
    """run.storage_path as a Location; a URI no pyarrow filesystem understands is a ConfigError."""
    try:
        storage = Location.of(storage_path)
        storage.filesystem  # noqa: B018 - parses the URI (scheme, query options) now
    except (ValueError, OSError, ImportError) as err:
        raise ConfigError(f"run.storage_path={redact_uri(storage_path)!r} is not a directory or a filesystem "
                          f"URI pyarrow understands ({redact_text(str(err), storage_path)}); fix "
                          "run.storage_path") from None
    return storage


def _check_writable(storage: Location) -> None:
    """run.storage_path exists (or can be made) and accepts files: checked by writing one and removing it.

    On an object store this is one PUT and one DELETE under the prefix: it fails on a missing bucket,
    an unreachable endpoint (after the SDK's retries, ~6 s measured against a closed port) or bad
    credentials.
    """
    local = storage.local
    if local is not None:
        try:
            local.mkdir(parents=True, exist_ok=True)
            probe = local / f".skrull-write-test-{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise ConfigError(
                f"run.storage_path={str(local)!r} is not a writable directory ({err.strerror}); "
                "point run.storage_path at a directory you can write"
            ) from None
        return
    probe = storage / f".skrull-write-test-{secrets.token_hex(4)}"
    try:
        probe.write_text("")
        probe.delete()
    except OSError as err:
        why = redact_text(str(err).splitlines()[0], storage.uri)
        raise ConfigError(f"run.storage_path={str(storage)!r} is not writable ({why}); {_REMOTE_HINT}, or "
                          "fix run.storage_path") from None
