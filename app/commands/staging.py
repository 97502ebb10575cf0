"""Writes that cannot lose data: a command's files go into a staging directory next to its --out and
replace --out's own files only when all of them are written (`data synth`, `data prepare`).
"""

from __future__ import annotations

import fnmatch
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from app.config import ConfigError


def _unwritable(out: Path, err: OSError) -> ConfigError:
    return ConfigError(f"--out={str(out)!r} cannot be written ({type(err).__name__}: {err}); nothing in it "
                       "was changed; choose a writable --out")


@contextmanager
def staged_output(out: Path, owned: tuple[str, ...] = ("*.parquet",)) -> Iterator[Path]:
    """Yield an empty staging directory; on a clean exit its files replace out's files that match `owned`
    (glob patterns: *.parquet for `data synth`; `data prepare` also owns its manifest).

        1. create out's missing parents; staging = a fresh temporary directory next to out (same parent,
           so the same filesystem and every rename below is atomic); inside out when out is a mount point
           or its parent cannot be written
        2. the caller writes every file into staging
        3. commit, when out is missing: rename(staging, out)
                   when out is a plain dir holding only owned files: rename(out, aside),
                       rename(staging, out), delete aside (a reader sees the old files or the new
                       ones, never a mix; between the two renames, for an instant, no directory)
                   otherwise (other files in out, a symlink, a mount point): move out's owned files into a
                       temporary dir inside out, move the new files in, delete the old ones; each step is a
                       rename, and a failure moves everything back
    On any exception (in the caller's writing or in the commit) staging and the parents this created are
    removed, out is exactly as it was, and an OSError comes back as one ConfigError naming --out.
    """
    created = _make_parents(out)
    staging: Path | None = None
    try:
        staging = _make_staging(out)
        yield staging
        _commit(staging, out, owned)
    except BaseException as err:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for directory in reversed(created):  # deepest first; rmdir only removes them while empty
            with suppress(OSError):
                directory.rmdir()
        if isinstance(err, OSError):
            raise _unwritable(out, err) from None
        raise


def _make_parents(out: Path) -> list[Path]:
    """mkdir out's missing parents; the ones created, outermost first (to remove them on failure)."""
    missing = [parent for parent in reversed(out.absolute().parents) if not parent.exists()]
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a parent is a file, or a read-only directory
        for directory in reversed(missing):
            with suppress(OSError):
                directory.rmdir()
        raise _unwritable(out, err) from None
    return missing


def _make_staging(out: Path) -> Path:
    """A fresh directory on out's filesystem, with the mode out has (or, when out is new, mkdir's)."""
    in_place = out.is_dir() and (os.path.ismount(out) or not os.access(out.absolute().parent, os.W_OK))
    where = out if in_place else out.absolute().parent
    while True:  # os.mkdir, not tempfile.mkdtemp (0700): after the rename this directory *is* out
        staging = where / f".{out.name}.synth-{secrets.token_hex(4)}"
        try:
            staging.mkdir()
            break
        except FileExistsError:
            continue
    if out.is_dir():
        staging.chmod(out.stat().st_mode & 0o7777)
    return staging


def _owned(path: Path, owned: tuple[str, ...]) -> bool:
    return path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in owned)


def _commit(staging: Path, out: Path, owned: tuple[str, ...]) -> None:
    if not out.exists():
        os.rename(staging, out)
        return
    only_owned = all(_owned(p, owned) for p in out.iterdir())
    if only_owned and staging.parent == out.absolute().parent and not out.is_symlink() \
            and not os.path.ismount(out):
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=staging.parent))
        os.rename(out, aside)  # onto the empty directory mkdtemp made: POSIX rename replaces it
        try:
            os.rename(staging, out)
        except OSError:
            os.rename(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return
    _swap_files(staging, out, owned)


def _swap_files(staging: Path, out: Path, owned: tuple[str, ...]) -> None:
    """Replace out's owned files with staging's one rename at a time, undoing every step on failure."""
    old_dir = Path(tempfile.mkdtemp(prefix=".synth-old-", dir=out))
    moved_old: list[Path] = []
    moved_new: list[Path] = []
    try:
        for old in sorted(p for p in out.iterdir() if _owned(p, owned)):
            os.rename(old, old_dir / old.name)
            moved_old.append(old)
        for new in sorted(staging.iterdir()):
            os.rename(new, out / new.name)
            moved_new.append(out / new.name)
    except OSError:
        for new in moved_new:
            with suppress(OSError):
                os.rename(new, staging / new.name)
        for old in moved_old:
            with suppress(OSError):
                os.rename(old_dir / old.name, old)
        shutil.rmtree(old_dir, ignore_errors=True)
        raise
    shutil.rmtree(old_dir, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
