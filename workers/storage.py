"""Where a run (or a dataset) lives: a local directory or a URI of any pyarrow filesystem (s3://, gs://, ...).

    Location.of("runs/x")                                   local: LocalFileSystem, absolute path
    Location.of("s3://bucket/runs/x?endpoint_override=h:p&scheme=http")
        -> pyarrow.fs.FileSystem.from_uri(...) = (S3FileSystem, "bucket/runs/x"); credentials, region and
           endpoint come from the URI's query or from the AWS_* environment variables (AWS_ACCESS_KEY_ID,
           AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, AWS_PROFILE) as the AWS SDK reads them

A Location is a plain string underneath (its URI, query included), so it travels to Ray workers as text and
each process builds its own filesystem from it (a filesystem handle is never pickled; one per URI root is
cached per process). It offers only what a run needs:

    exists / is_file / is_dir   read_text   write_text (atomic)   append_lines   listdir   rmtree
    copy_tree_from_local / copy_tree_to_local (pyarrow.fs.copy_files)

Atomicity: a local write goes to a temporary file that replaces the target (os.replace); an object store
PUTs the whole object when the stream closes. A reader sees the old or the new version, never a part: on
an object store read_bytes checks that the version it read is still the one there after the read (pyarrow
alone can return a mix when the object is replaced mid-read; see read_bytes).
Object stores cannot append (pyarrow raises ArrowNotImplementedError for S3), so append_lines there reads
the object and writes it back whole: two requests per call and O(size) bytes (samples.jsonl grows by one
line per DP rank and step; at 10k steps of 512 samples that is ~30 MB rewritten per step, so a very long
run on an object store should checkpoint rarely enough that this stays small next to a step).

Secrets: str(location) is the URI without secrets (redact_uri: the userinfo `user:password@` and the
access_key / secret_key / session_token query values become ***); redact_text scrubs them out of any text
(pyarrow's error messages repeat the URI they failed on). A run's config refuses a URI with credentials
(`carries_credentials`): they belong in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

_SECRET_KEYS = frozenset({"access_key", "secret_key", "session_token"})
_HIDDEN = "***"
# In free text: a secret query value (up to the next &, quote, space or bracket), and a URI's userinfo.
_SECRET_QUERY_TEXT = re.compile(r"\b(access_key|secret_key|session_token)=[^&\s'\"()\[\]<>]+")
_USERINFO_TEXT = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@'\"]*@")


# A read of an object that keeps being replaced (app/rundir/lock.py renews its lease every few seconds)
# is retried this often, pausing 10 ms, 20 ms, ... (2.5 s in all) between tries.
_READ_ATTEMPTS = 8
_READ_PAUSE_S = 0.01


def _headers(stream: Any) -> dict[str, bytes]:
    """The version headers an object-store stream's HEAD returned (empty where the store gives none)."""
    return dict(stream.metadata() or {})


def carries_credentials(uri: str) -> bool:
    """True for a URI with credentials in it: `user[:password]@` before its host, or an access_key /
    secret_key / session_token query value (pyarrow 26's S3 URIs refuse the latter anyway)."""
    if "://" not in uri:
        return False
    parts = urlsplit(uri)
    return "@" in parts.netloc or any(key in _SECRET_KEYS for key, _ in parse_qsl(parts.query))


def redact_uri(uri: str) -> str:
    """`uri` without secrets: its userinfo and secret query values become ***; anything else unchanged."""
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{_HIDDEN}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if any(key in _SECRET_KEYS for key, _ in parse_qsl(query)):
        query = urlencode([(k, _HIDDEN if k in _SECRET_KEYS else v) for k, v in parse_qsl(query)], safe=":*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def uri_secrets(uri: str) -> list[str]:
    """The secret strings a URI carries (userinfo parts, secret query values), as written and decoded."""
    if "://" not in uri:
        return []
    parts = urlsplit(uri)
    found = [v for k, v in parse_qsl(parts.query) if k in _SECRET_KEYS]
    found += [raw for k, raw in (p.split("=", 1) for p in parts.query.split("&") if "=" in p)
              if k in _SECRET_KEYS]
    if "@" in parts.netloc:
        found += [piece for piece in parts.netloc.rsplit("@", 1)[0].split(":") if piece]
    found += [unquote(value) for value in found]
    return sorted({value for value in found if len(value) >= 3}, key=len, reverse=True)


def redact_text(text: str, *uris: str) -> str:
    """`text` without secrets: those of `uris` wherever they appear (pyarrow repeats URIs, whole or in
    parts, in its errors), and any secret query value or userinfo of a URI written in it."""
    for uri in uris:
        for secret in uri_secrets(uri):
            text = text.replace(secret, _HIDDEN)
    text = _SECRET_QUERY_TEXT.sub(lambda m: f"{m.group(1)}={_HIDDEN}", text)
    return _USERINFO_TEXT.sub(lambda m: f"{m.group(1)}{_HIDDEN}@", text)


def is_remote(where: str | os.PathLike[str]) -> bool:
    """True for a URI with a scheme other than file:// (s3://, gs://, hdfs://, ...)."""
    text = os.fspath(where)
    scheme = urlsplit(text).scheme if "://" in text else ""
    return bool(scheme) and scheme != "file"


@functools.lru_cache(maxsize=64)
def _filesystem(root_uri: str) -> Any:
    """One pyarrow filesystem per (scheme, authority, query) and process; from_uri reads the environment."""
    from pyarrow import fs

    return fs.FileSystem.from_uri(root_uri)[0]


@dataclass(frozen=True, slots=True)
class Location:
    """A file or directory: `uri` is an absolute local path or a remote URI (query string included)."""

    uri: str

    @classmethod
    def of(cls, where: str | os.PathLike[str] | Location) -> Location:
        """A Location from a path (made absolute, `~` expanded), a URI, or a Location."""
        if isinstance(where, Location):
            return where
        text = os.fspath(where)
        if text.startswith("file://"):
            text = urlsplit(text).path
        if not is_remote(text):
            text = str(Path(text).expanduser().resolve())
        return cls(text)

    @property
    def is_local(self) -> bool:
        return not is_remote(self.uri)

    @property
    def local(self) -> Path | None:
        """The local path, or None for a remote location."""
        return Path(self.uri) if self.is_local else None

    @property
    def filesystem(self) -> Any:
        """The pyarrow filesystem holding this location (LocalFileSystem for a local path)."""
        if self.is_local:
            from pyarrow import fs

            return fs.LocalFileSystem()
        parts = urlsplit(self.uri)
        return _filesystem(urlunsplit((parts.scheme, parts.netloc, "", parts.query, "")))

    @property
    def path(self) -> str:
        """The path inside `filesystem` (S3: "bucket/key"), as pyarrow and Ray Train's storage take it."""
        if self.is_local:
            return self.uri
        parts = urlsplit(self.uri)
        if parts.scheme in ("s3", "gs", "gcs", "abfs", "abfss"):  # the bucket/container is the first part
            return f"{parts.netloc}{parts.path}".rstrip("/")
        return parts.path.rstrip("/") or "/"

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, name: str) -> Location:
        if self.is_local:
            return Location(str(Path(self.uri) / name))
        parts = urlsplit(self.uri)
        return Location(urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}")))

    def __str__(self) -> str:
        return self.uri if self.is_local else redact_uri(self.uri)

    # -- queries ---------------------------------------------------------------------------------------
    def _type(self) -> Any:
        return self.filesystem.get_file_info(self.path).type

    def exists(self) -> bool:
        from pyarrow import fs

        return self._type() != fs.FileType.NotFound

    def is_file(self) -> bool:
        from pyarrow import fs

        return self._type() == fs.FileType.File

    def is_dir(self) -> bool:
        from pyarrow import fs

        return self._type() == fs.FileType.Directory

    def listdir(self) -> list[str]:
        """Names directly inside this directory, sorted ([] when it does not exist)."""
        from pyarrow import fs

        infos = self.filesystem.get_file_info(fs.FileSelector(self.path, allow_not_found=True))
        return sorted(info.base_name for info in infos)

    def files(self) -> list[Location]:
        """Every file below this directory (recursive), in sorted path order; [] when it does not exist."""
        from pyarrow import fs

        infos = self.filesystem.get_file_info(fs.FileSelector(self.path, recursive=True,
                                                              allow_not_found=True))
        root = self.path.rstrip("/")
        relative = sorted(i.path[len(root) + 1:] for i in infos if i.type == fs.FileType.File)
        return [self / rel for rel in relative]

    # -- reads and writes ------------------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        """The whole file, one version of it.

        pyarrow reads an object as a HEAD (its size and version headers) and then a GET of that byte range,
        and it returns the HEAD's size even when the GET brought fewer bytes: an object replaced between the
        two came back cut, or with a tail of stale memory. So an object-store read is kept only when a
        second HEAD after the GET reports the same headers (ETag, Last-Modified, Content-Length) as the
        first, and is repeated otherwise, with a short growing pause, up to _READ_ATTEMPTS times. What this
        cannot see is a writer putting back the very bytes the first HEAD saw within one read (A -> B -> A).
        """
        if self.is_local:
            with self.filesystem.open_input_stream(self.path) as stream:
                return stream.read()
        for attempt in range(_READ_ATTEMPTS):
            with self.filesystem.open_input_stream(self.path) as stream:
                version, data = _headers(stream), stream.read()
            with self.filesystem.open_input_file(self.path) as after:
                if _headers(after) == version:
                    return data
            time.sleep(_READ_PAUSE_S * 2**attempt)
        raise OSError(f"{self}: the object was replaced during each of {_READ_ATTEMPTS} reads of it")

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def write_text(self, text: str) -> None:
        """Replace the file's content atomically (local: temp file + os.replace; object store: one PUT)."""
        local = self.local
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f".{local.name}.{secrets.token_hex(4)}.tmp")
            try:
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)
            return
        with self.filesystem.open_output_stream(self.path) as stream:
            stream.write(text.encode("utf-8"))

    def append_lines(self, lines: list[str]) -> None:
        """Append lines (each gets a newline): a real append locally, read + rewrite on an object store."""
        text = "".join(line + "\n" for line in lines)
        local = self.local
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
            with local.open("a", encoding="utf-8") as out:
                out.write(text)
            return
        self.write_text((self.read_text() if self.exists() else "") + text)

    def delete(self) -> None:
        """Remove this file or directory tree; nothing happens when it does not exist."""
        if not self.exists():
            return
        if self.is_dir():
            self.filesystem.delete_dir(self.path)
        else:
            self.filesystem.delete_file(self.path)

    rmtree = delete

    def copy_from_local(self, directory: Path) -> None:
        """Copy every file below the local `directory` into this directory (overwriting same names)."""
        from pyarrow import fs

        if any(p.is_file() for p in directory.rglob("*")):
            fs.copy_files(str(directory), self.path, source_filesystem=fs.LocalFileSystem(),
                          destination_filesystem=self.filesystem)

    def move_to(self, target: Location, *, last: tuple[str, ...] = ()) -> None:
        """This directory becomes `target` (which must not exist). Local: one rename, atomic. An object
        store has no directory rename: each file is moved (a server-side copy, then a delete), the files
        named in `last` after every other one, so that a reader who waits for those finds the rest."""
        if self.is_local:
            os.replace(self.uri, target.uri)
            return
        root = self.path.rstrip("/")
        for file in sorted(self.files(), key=lambda f: f.name in last):
            self.filesystem.move(file.path, f"{target.path}/{file.path[len(root) + 1:]}")
        self.delete()

    def copy_to_local(self, directory: Path, *, skip: tuple[str, ...] = ()) -> None:
        """Copy every file below this directory into the local `directory`, except those whose first
        path component starts with one of `skip`."""
        root = self.path.rstrip("/")
        for file in self.files():
            relative = file.path[len(root) + 1:]
            if relative.split("/", 1)[0].startswith(skip):
                continue
            target = directory / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(file.read_bytes())


# -- the driver's local mirror of a remote run -------------------------------------------------------------
MIRROR_SKIP = ("checkpoint", "samples.jsonl", "skrull_", ".", "hf")
"""Run files the mirror never holds: Ray Train's checkpoints and bookkeeping, the workers' samples.jsonl,
the config and data snapshots (skrull_*.json), the run lease (.skrull-lease.json) and the exported model
(hf/, .hf-export/: workers/hf_export.py) are written to the store directly, and a copy back must never
overwrite them."""


def mirror_directory(run: Location) -> Path:
    """The local directory standing in for a remote run on the driver (one per run URI)."""
    key = hashlib.sha256(run.uri.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir(), "skrull-mirror", key, run.name)


def pull_mirror(run: Location) -> Path:
    """A fresh local mirror of `run` holding its driver-side files (logs/, tensorboard/, ...) from earlier
    calls, so that a resumed run appends to them; returns its path."""
    mirror = mirror_directory(run)
    shutil.rmtree(mirror, ignore_errors=True)
    mirror.mkdir(parents=True)
    run.copy_to_local(mirror, skip=MIRROR_SKIP)
    return mirror


def push_mirror(mirror: Path, run: Location) -> None:
    """Copy the mirror into the run's storage and remove it; on a storage error keep it and say where."""
    try:
        run.copy_from_local(mirror)
    except OSError as err:
        print(f"warning: could not copy {mirror} into {run} ({str(err).splitlines()[0]}); the driver's "
              "log and TensorBoard files stay in that local directory", file=sys.stderr, flush=True)
        return
    shutil.rmtree(mirror, ignore_errors=True)
