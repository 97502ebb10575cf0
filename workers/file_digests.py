"""SHA-256 of large files piece by piece, the pieces in parallel threads: the checkpoint manifests'
digests (workers/checkpoint_files.py).

One SHA-256 stream runs at about 1.9 GB/s on one core (with the CPU's SHA extensions), so one stream over
a rank's 8.8 GB shard of the 0.5B model took 4.8 s from the page cache on the 2-core VM, and the run waited
for it at every checkpoint. A file is cut into pieces of `piece_bytes`, each hashed on its own (hashlib's
update and pyarrow's reads release the GIL) by up to HASH_THREADS threads; a file's digest is the list of
its pieces' digests, in order. Every piece opens the file itself through `open_file`, a pyarrow
filesystem's `open_input_file` (local or an object store: ranged reads).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PIECE_BYTES = 256 << 20
READ_BYTES = 8 << 20
HASH_THREADS = 8
"""At most this many threads hash at once (fewer on a machine with fewer cores)."""


def piece_digests(files: Mapping[str, int], open_file: Callable[[str], Any],
                  piece_bytes: int = PIECE_BYTES) -> dict[str, list[str]]:
    """name -> the SHA-256 hex digest of each `piece_bytes` piece, of every file in `files` (name -> its
    size in bytes), read with `open_file(name).read_at(nbytes, offset)`. An empty file has one piece, the
    digest of nothing; a file shorter than its size gives the digests of what it holds."""
    jobs = [(name, offset, min(piece_bytes, size - offset)) for name, size in files.items()
            for offset in range(0, max(size, 1), piece_bytes)]
    threads = max(1, min(HASH_THREADS, os.cpu_count() or 1, len(jobs)))
    with ThreadPoolExecutor(threads) as pool:
        digests = list(pool.map(lambda job: _piece_digest(open_file, *job), jobs))
    result: dict[str, list[str]] = {name: [] for name in files}
    for (name, _, _), digest in zip(jobs, digests, strict=True):
        result[name].append(digest)
    return result


def _piece_digest(open_file: Callable[[str], Any], name: str, offset: int, size: int) -> str:
    digest = hashlib.sha256()
    end = offset + size
    with open_file(name) as stream:
        while offset < end:
            chunk = stream.read_at(min(READ_BYTES, end - offset), offset)
            if not chunk:
                break
            digest.update(chunk)
            offset += len(chunk)
    return digest.hexdigest()
