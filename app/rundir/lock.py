"""One writer per run: a lock in the run's own storage, taken by `train` before it writes anything there.

Two `train` calls on the same <run.storage_path>/<run.name> would mix their checkpoints, samples.jsonl and
metrics; the second call stops at once instead (RunLocked, exit 2) and names the holder (host, pid, start).

Local or mounted run directory (`FileLock`): <run>/.skrull-lock, held with flock(LOCK_EX | LOCK_NB) on an
open file for the whole call. The kernel drops the lock when the holder exits however it exits (Ctrl-C,
SIGTERM, an exception, SIGKILL), so a dead holder never blocks a run. The file names the holder (written
after the lock is taken) and is emptied on a clean release; a holder named in a file whose lock is free
ended without releasing it (killed), and is taken over with a warning. On NFS, Linux emulates flock with
POSIX byte-range locks, which the server arbitrates between clients (a `nolock` mount has no locking).

Object store (`Lease`): <run>/.skrull-lease.json = {host, pid, started, token, renewed}; a heartbeat thread
rewrites `renewed` every HEARTBEAT_S. The lease is free when absent, released, or stale: `renewed` older
than LEASE_TIMEOUT_S (the holder's clock: hosts' clocks must agree to well within that bound, as NTP
keeps them), or held by a process of this host that no longer exists (pid and start time checked).
Taking a lease: read it; if free, write ours, wait SETTLE_S, read it back: only the caller whose token
came back holds it. pyarrow's S3 filesystem offers no conditional write (open_output_stream ignores
an If-None-Match header: checked with pyarrow 26 against moto, which does honour the header through
boto3), so the exclusion rests on that read-back: two callers that both saw the lease free each write,
and the later write wins, as long as each wrote within SETTLE_S of its own read. A caller slower than
that between its read and its write (a stall of over a second) could still believe it won alongside the
other; the heartbeat then finds the other's token and stops the loser (`on_lost`). A holder whose
heartbeat stalls past LEASE_TIMEOUT_S (a frozen process, a partition) may be taken over in the same way;
its next heartbeat finds the new token and stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from app.config import ConfigError
from workers.storage import Location, redact_text

LOCK_FILE = ".skrull-lock"
LEASE_FILE = ".skrull-lease.json"
HEARTBEAT_S = 10.0
"""How often a lease holder renews its lease."""
LEASE_TIMEOUT_S = 60.0
"""A lease not renewed for this long belongs to a dead or stalled holder and may be taken over."""
SETTLE_S = 1.0
"""How long a writer waits before reading its lease back (the bound on the read-to-write race above)."""


class RunLocked(ConfigError):
    """Another `train` call holds the run (the message names it)."""


def holder_record() -> dict[str, Any]:
    """Who this process is: host, pid, process start time, a fresh token, and the wall time now."""
    import psutil

    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": psutil.Process().create_time(),
            "started": datetime.fromtimestamp(now).isoformat(timespec="seconds"),
            "token": secrets.token_hex(8), "renewed": now}


def describe(holder: dict[str, Any]) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


def gone_from_this_host(holder: dict[str, Any]) -> bool:
    """True when the holder ran on this host and its process no longer exists (pid reuse is told apart by
    the process start time)."""
    import psutil

    if holder.get("host") != socket.gethostname():
        return False
    try:
        started = psutil.Process(int(holder["pid"])).create_time()
    except (psutil.Error, KeyError, TypeError, ValueError):
        return True
    recorded = holder.get("pid_started")
    return recorded is not None and abs(started - float(recorded)) > 1.0


def _locked_error(run: Location, holder: dict[str, Any], detail: str = "") -> RunLocked:
    return RunLocked(f"run {run.name!r} ({run}) is being written by another `train` call ({describe(holder)}"
                     f"{detail}); two writers would mix their checkpoints and samples. Wait for it to end or "
                     "stop it, or use another run.name")


class FileLock:
    """flock on <run>/.skrull-lock (see the module docstring)."""

    def __init__(self, run: Location, *, out: TextIO) -> None:
        assert run.local is not None
        self.run, self.path, self.out = run, run.local / LOCK_FILE, out
        self._file: Any = None

    def acquire(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(self.path)
            handle.close()
            raise _locked_error(self.run, holder) from None
        previous = _read_holder(self.path)
        if previous:
            print(f"warning: run {self.run.name!r}: taking over the lock of a `train` call that ended "
                  f"without releasing it ({describe(previous)})", file=self.out, flush=True)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(holder_record()))
        handle.flush()
        self._file = handle

    def release(self) -> None:
        import fcntl

        if self._file is None:
            return
        handle, self._file = self._file, None
        with contextlib.suppress(OSError):  # the directory may be gone (a new run removed on an error)
            handle.truncate(0)
            fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


class Lease:
    """A heartbeat-renewed lease object in the run's object store (see the module docstring)."""

    def __init__(self, run: Location, *, out: TextIO, on_lost: Callable[[], None] | None = None,
                 heartbeat_s: float = HEARTBEAT_S, settle_s: float = SETTLE_S) -> None:
        self.run, self.where, self.out, self.on_lost = run, run / LEASE_FILE, out, on_lost
        self.heartbeat_s, self.settle_s = heartbeat_s, settle_s
        self.record: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.where.read_text()) if self.where.exists() else {}
        except (OSError, ValueError):
            return {}  # unreadable: treated as free, and overwritten

    def acquire(self) -> None:
        current = self.read()
        if current:
            age = time.time() - float(current.get("renewed", 0))
            if age < LEASE_TIMEOUT_S and not gone_from_this_host(current):
                raise _locked_error(self.run, current, f"; its lease was renewed {age:.0f} s ago and is "
                                                       f"taken over once {LEASE_TIMEOUT_S:.0f} s old")
            print(f"warning: run {self.run.name!r}: taking over the lease of a `train` call that stopped "
                  f"renewing it ({describe(current)}, renewed {age:.0f} s ago)", file=self.out, flush=True)
        self.record = holder_record()
        self.where.write_text(json.dumps(self.record))
        try:
            time.sleep(self.settle_s)
            back = self.read()
        except BaseException:  # Ctrl-C / SIGTERM while settling: leave no lease of ours behind
            self._delete_if_ours()
            raise
        if back.get("token") != self.record["token"]:
            raise _locked_error(self.run, back, "; it took the lease at the same moment")
        self._thread = threading.Thread(target=self._beat, name="skrull-run-lease", daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        """Rewrite `renewed` if the lease is still ours (or gone: a run removed after a ConfigError); False
        (after calling on_lost) when another token holds it."""
        current = self.read()
        if current and current.get("token") != self.record["token"]:  # absent: nobody else holds it
            print(f"error: run {self.run.name!r}: another `train` call took over this call's lease "
                  f"({describe(current)}); stopping this call",
                  file=self.out, flush=True)
            if self.on_lost is not None:
                self.on_lost()
            return False
        self.record["renewed"] = time.time()
        self.where.write_text(json.dumps(self.record))
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self.renew():
                    return
            except OSError as err:  # a store hiccup: the next beat retries (the bound allows several)
                print(f"warning: run {self.run.name!r}: could not renew the run lease "
                      f"({redact_text(str(err).splitlines()[0], self.run.uri)})", file=self.out, flush=True)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._delete_if_ours()

    def _delete_if_ours(self) -> None:
        with contextlib.suppress(OSError):
            if self.record and self.read().get("token") == self.record["token"]:
                self.where.delete()


@contextlib.contextmanager
def run_lock(run: Location, *, out: TextIO | None = None,
             on_lost: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the run's lock (local: FileLock; object store: Lease) for the duration; RunLocked when another
    call holds it. Released on every way out of the block (an exception, Ctrl-C, SIGTERM as an exception)."""
    out = out or sys.stderr
    lock = FileLock(run, out=out) if run.is_local else Lease(run, out=out, on_lost=on_lost)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()
