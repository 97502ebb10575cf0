"""What data a run trains on, as a small record: part of a run's identity, compared when it resumes.

    synthetic    {"source": "synthetic", distribution, num_samples, seed, length_scale}
    path         {"source": "path", "format", "files": [[name, size, head_tail_sha256], ...]}

For a dataset on disk every file the readers read (parquet / jsonl files in read order; for a `datasets`
save_to_disk directory every file below it, its arrow shards and state.json with the datasets
fingerprint included) is recorded by its name relative to the dataset's path, its size, and a SHA-256 of
its first and last HEAD_TAIL_BYTES bytes (the whole file when smaller than twice that). Cost: at most
2 x 64 KiB read per file, whatever its size (one ranged read each on an object store), so large data is
never re-read. A parquet file's tail is its footer (schema, row groups and their statistics), so a
rewritten parquet file shows there; what it cannot see is an edit that keeps a file's size and leaves
its first and last 64 KiB alone (a same-length edit in the middle of a large JSONL file).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from app.config import DataConfig
from app.data.readers import DataSource

HEAD_TAIL_BYTES = 64 << 10


def data_fingerprint(data: DataConfig, source: DataSource | None, path: str | None = None) -> dict[str, Any]:
    """The record above for `data` (`source`: its resolved files, None for synthetic data); `path` is the
    dataset path the file names are relative to (default data.path; data.eval_path for the eval set)."""
    if source is None:
        return {"source": "synthetic", "distribution": data.distribution, "num_samples": data.num_samples,
                "seed": data.seed, "length_scale": data.length_scale}
    root = path if path is not None else data.path
    return {"source": "path", "format": source.format,
            "files": [[name, size, digest] for name, size, digest in _files(source, root)]}


def _files(source: DataSource, root: str) -> list[tuple[str, int, str]]:
    """(name relative to the dataset's path, size, head+tail digest) of every file the source reads."""
    from pyarrow import fs

    filesystem = source.filesystem or fs.LocalFileSystem()
    files = list(source.files)
    if source.format == "hf":  # a save_to_disk directory: every file below it
        selector = fs.FileSelector(files[0], recursive=True)
        files = sorted(i.path for i in filesystem.get_file_info(selector) if i.type == fs.FileType.File)
    rows = []
    for file in files:
        size, digest = _head_tail_digest(filesystem, file)
        rows.append((_relative(file, root, remote=source.filesystem is not None), size, digest))
    return rows


def _relative(file: str, root: str, *, remote: bool) -> str:
    """`file`'s name relative to the dataset's path `root`; a dataset that is one file: its base name."""
    from workers.storage import Location

    if remote:
        base = Location.of(root).path.rstrip("/")
        return file[len(base) + 1:] if file.startswith(base + "/") else file.rsplit("/", 1)[-1]
    try:
        relative = str(Path(file).resolve().relative_to(Path(root).expanduser().resolve()))
    except ValueError:
        relative = "."
    return Path(file).name if relative == "." else relative


def _head_tail_digest(filesystem: Any, file: str) -> tuple[int, str]:
    """(size, SHA-256 hex of size + first + last HEAD_TAIL_BYTES bytes): at most 2 x 64 KiB read."""
    with filesystem.open_input_file(file) as handle:
        size = handle.size()
        digest = hashlib.sha256(str(size).encode())
        digest.update(handle.read_at(min(size, HEAD_TAIL_BYTES), 0))
        if size > HEAD_TAIL_BYTES:
            tail = min(HEAD_TAIL_BYTES, size - HEAD_TAIL_BYTES)
            digest.update(handle.read_at(tail, size - tail))
    return size, digest.hexdigest()[:32]


def describe_change(before: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between two records, in a few words (files added, removed, changed)."""
    if before.get("source") != now.get("source") or before.get("source") == "synthetic":
        changed = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
                   if before.get(k) != now.get(k)]
        return ", ".join(changed)
    old = {name: (size, digest) for name, size, digest in before.get("files", [])}
    new = {name: (size, digest) for name, size, digest in now.get("files", [])}
    parts = [f"{name} added" for name in new if name not in old]
    parts += [f"{name} removed" for name in old if name not in new]
    for name in (n for n in new if n in old and new[n] != old[n]):
        (was, _), (size, _) = old[name], new[name]
        parts.append(f"{name} changed " + (f"({was} -> {size} bytes)" if was != size else "(content)"))
    if before.get("format") != now.get("format"):
        parts.insert(0, f"format {before.get('format')} -> {now.get('format')}")
    shown = parts[:3] + ([f"{len(parts) - 3} more"] if len(parts) > 3 else [])
    return ", ".join(shown) or "the files differ"
