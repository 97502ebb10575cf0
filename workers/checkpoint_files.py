"""A checkpoint's files: written with a manifest per rank, copied into the run's storage whole or not at all,
verified against the manifests before a resume.

    checkpoint_<time>/                   Ray Train's name for a new checkpoint, chosen by world rank 0
      skrull_manifest_rank<RRRRR>.json   {"rank": R, "files": {relative path: {"size", "piece_bytes",
                                         "sha256_pieces"}}}: the files world rank R wrote, hashed right after
                                         writing them, piece by piece (workers/file_digests.py); manifests
                                         written before the pieces hold one "sha256" of the whole file
      step<N>/ ... latest skrull_state.json   (workers/checkpoints.py)

`save_checkpoint` (every rank): DeepSpeed's shard into a local temporary directory, this rank's manifest
there, the directory copied into <run_dir>/<checkpoint name> (`copy_into`, pyarrow: a local path or an
object store alike; renamed into place when the temporary directory, $TMPDIR, is on the run's own
filesystem), then one all_gather of the ranks' copy errors. A copy that failed anywhere (disk
full, quota, permission) is removed before anything registers it: the train loop reports a checkpoint to
Ray Train (which records it as the newest) only when every rank copied it completely
(workers/train_loop.py).

Verification (`problems`) checks that every rank's manifest is there (skrull_state.json names the world
size) and that every listed file exists with the recorded size and SHA-256. Cost: hashing at save time
reads each rank's own files once more (from the page cache, right after writing), in parallel pieces;
verifying reads the whole checkpoint once (an object store: one download of it, in ranged reads). A
checkpoint without manifests (written before they existed) cannot be verified and is taken as it is.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.checkpoints import STATE_FILE, CheckpointState
from workers.file_digests import PIECE_BYTES, piece_digests
from workers.storage import Location
from workers.storage_errors import reason_of, storage_message, storage_path_of

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

MANIFEST_PREFIX = "skrull_manifest_rank"
_CHUNK = 8 << 20


def manifest_name(rank: int) -> str:
    return f"{MANIFEST_PREFIX}{rank:05d}.json"


def _sha256(stream: Any) -> str:
    digest = hashlib.sha256()
    while chunk := stream.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: str | Path, rank: int) -> None:
    """Record size and SHA-256 pieces of every file below `directory` (what this rank wrote) in its
    manifest."""
    from pyarrow import fs

    root = Path(directory)
    written = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(MANIFEST_PREFIX))
    sizes = {path.relative_to(root).as_posix(): path.stat().st_size for path in written}
    local = fs.LocalFileSystem()
    piece = PIECE_BYTES
    digests = piece_digests(sizes, lambda name: local.open_input_file(str(root / name)), piece)
    files = {name: {"size": size, "piece_bytes": piece, "sha256_pieces": digests[name]}
             for name, size in sizes.items()}
    (root / manifest_name(rank)).write_text(json.dumps({"rank": rank, "files": files}, indent=1))


def copy_into(directory: str | Path, filesystem: Any, target: str) -> None:
    """Put every file below the local `directory` into `target` on `filesystem` (pyarrow); raises OSError.

    On the same local filesystem as `directory` the files are renamed into place (no data moves: pyarrow
    took 22.4 s to copy an 8.8 GB 0.5B checkpoint on the CI machine's disk); anywhere else they are
    copied, as Ray Train's own upload does (ray/train/v2/_internal/execution/storage.py
    _pyarrow_fs_copy_files): 64 MiB chunks, and no threads towards S3 (pyarrow's threaded S3 upload is
    unsafe, apache/arrow#32372).
    """
    from pyarrow import fs

    if isinstance(filesystem, fs.LocalFileSystem):
        if _same_device(Path(directory), Path(target)):
            _rename_into(Path(directory), Path(target))
            return
        check_room(Path(directory), Path(target))
    threads = not isinstance(filesystem, getattr(fs, "S3FileSystem", ()))
    filesystem.create_dir(target, recursive=True)
    fs.copy_files(str(directory), target, source_filesystem=fs.LocalFileSystem(),
                  destination_filesystem=filesystem, chunk_size=64 << 20, use_threads=threads)


def _same_device(directory: Path, target: Path) -> bool:
    """`directory` and the nearest existing directory at or above `target` lie on one filesystem."""
    return directory.stat().st_dev == _existing(target).stat().st_dev


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing ancestor."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


ROOM_KEPT_BYTES = 1 << 20
"""What a checkpoint copy leaves free on a local filesystem for the run's own small writes."""


def check_room(directory: Path, target: Path) -> None:
    """Refuse (OSError ENOSPC naming `target`) a copy of `directory` into the local `target` that would
    leave less than ROOM_KEPT_BYTES free. A copy that fills the disk fails itself and, until its partial
    files are removed, every other write into the run's storage too: the driver's metrics.jsonl line or
    Ray Train's snapshot can then be the write that fails, and the run stops on that instead of on the
    checkpoint. Ranks sharing one filesystem check at the same time, so together they can still fill it
    (the partial checkpoint is then removed as before)."""
    needed = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    free = shutil.disk_usage(_existing(target)).free
    if needed > free - ROOM_KEPT_BYTES:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))


def _rename_into(directory: Path, target: Path) -> None:
    """Move every file below `directory` to the same relative path below `target` by rename."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        destination = target / path.relative_to(directory)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, destination)


def remove(filesystem: Any, target: str) -> None:
    """Delete the directory `target` on `filesystem` if it exists."""
    from pyarrow import fs

    if filesystem.get_file_info(target).type != fs.FileType.NotFound:
        filesystem.delete_dir(target)


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    name: str
    """Ray Train's name for it (checkpoint_<time>), chosen by world rank 0."""
    checkpoint: Any = None
    """The ray.train.Checkpoint in the run's storage; None when it could not be written."""
    failure: str | None = None
    """Why it could not be written (one line naming run.storage_path), or None."""


def save_checkpoint(engine: DeepSpeedEngine, state: CheckpointState, world_group: Any,
                    run_dir: str) -> SavedCheckpoint:
    """Every rank (collective): save `engine` and `state` into a temp dir, write this rank's manifest, copy
    the dir into <run_dir>/<name>. When any rank's copy failed, world rank 0 removes the partial directory
    and the result says why, naming run.storage_path."""
    import ray.train
    import torch.distributed as dist  # lazy: the driver verifies checkpoints (problems) without torch

    storage = ray.train.get_context().get_storage()
    # Ray Train's own upload first checks that this node sees the run's storage (a local run.storage_path
    # not shared by every node fails here, naming it); its check is kept for the copies made here.
    getattr(storage, "_check_validation_file", lambda: None)()
    rank = dist.get_rank()
    names = [storage.make_default_checkpoint_dir_name() if rank == 0 else None]  # Ray Train's own naming
    dist.broadcast_object_list(names, src=0, group=world_group)  # once per checkpoint, not per step
    name = names[0]
    filesystem, target = storage.storage_filesystem, storage.build_checkpoint_path_from_name(name)
    rooms: list[str | None] = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(rooms, temp_room_problem(engine), group=world_group)  # once per checkpoint
    short = {r: problem for r, problem in enumerate(rooms) if problem is not None}
    if short:  # every rank saw the same verdicts: none saves, so none waits in DeepSpeed's barriers
        return SavedCheckpoint(name, failure=_temp_room_failure(name, state.step, short))
    with tempfile.TemporaryDirectory(prefix="skrull-ckpt-") as tmp:
        # LoRA: frozen base weights are rebuilt from the config, so the checkpoint holds only the adapter.
        frozen = not all(p.requires_grad for p in engine.module.parameters())
        engine.save_checkpoint(tmp, tag=state.tag, client_state={"skrull": asdict(state)},
                               exclude_frozen_parameters=frozen)
        if rank == 0:
            state.write(tmp)
        error = _try(write_manifest, tmp, rank) or _try(copy_into, tmp, filesystem, target)
    errors: list[str | None] = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(errors, error, group=world_group)  # once per checkpoint, not per step
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if not failed:
        return SavedCheckpoint(name, checkpoint=ray.train.Checkpoint(path=target, filesystem=filesystem))
    left = _try(remove, filesystem, target) if rank == 0 else None
    what = f"writing {name} (step {state.step}) on rank(s) {', '.join(map(str, failed))}"
    fate = f"the partial {name} was removed" if left is None else f"the partial {name} is left ({left})"
    reason = storage_message(storage_path_of(run_dir), what, next(iter(failed.values())))
    return SavedCheckpoint(name, failure=f"{reason}; {fate}")


def shard_bytes(engine: DeepSpeedEngine) -> int:
    """About the bytes of this rank's DeepSpeed checkpoint shard: the fp32 masters and the optimizer state
    of the torch optimizer under DeepSpeed's wrapper (this rank's partition), and the module's trained
    parameters on a rank that writes the model file (ZeRO-3's module holds no full parameters; a LoRA
    run's frozen base weights are not saved: save_checkpoint's exclude_frozen_parameters)."""
    import torch

    from workers.optimizer_state import inner_optimizer, masters_by_group

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    trained = (p for p in engine.module.parameters() if p.requires_grad)
    total = nbytes(trained) if engine.save_non_zero_checkpoint else 0
    inner = inner_optimizer(engine.optimizer)
    if inner is None:
        return total
    masters = masters_by_group(engine.optimizer, inner)
    return (total + nbytes(t for group in masters.values() for t in group)
            + nbytes(v for state in inner.state.values() for v in state.values()))


def temp_room_problem(engine: DeepSpeedEngine) -> str | None:
    """Why this rank's shard would not fit in the temporary directory it is written into first
    (tempfile.gettempdir(): TMPDIR, else /tmp), or None. A full one fails inside torch.save with a message
    that names no file; checked before saving, every rank can stop at the same point."""
    root = tempfile.gettempdir()
    need, free = shard_bytes(engine), shutil.disk_usage(root).free
    if need + ROOM_KEPT_BYTES <= free:
        return None
    return f"{root} has {free / 2**20:,.1f} MiB free, this rank's shard needs about {need / 2**20:,.1f} MiB"


def _temp_room_failure(name: str, step: int, short: dict[int, str]) -> str:
    ranks = ", ".join(map(str, short))
    return (f"writing {name} (step {step}): the temporary directory each rank writes its shard into before "
            f"it moves into run.storage_path is too small on rank(s) {ranks} ({next(iter(short.values()))}). "
            "Set TMPDIR in the workers' environment (where Ray starts on each node, or the job's "
            "runtime_env) to a directory on a larger disk and rerun the same command to resume from the "
            "newest complete checkpoint")


def _try(write: Any, *args: Any) -> str | None:
    """Run a write into storage; its OSError (disk full, quota, permission, an unreachable object store)
    in a few words, or None."""
    try:
        write(*args)
    except OSError as err:
        return reason_of(err)
    return None


def problems(checkpoint: Location) -> list[str]:
    """What is wrong with `checkpoint`'s files against its manifests ([]: complete, or no manifests)."""
    from pyarrow import fs

    filesystem, root = checkpoint.filesystem, checkpoint.path.rstrip("/")
    infos = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
    sizes = {i.path[len(root) + 1:]: i.size for i in infos if i.type == fs.FileType.File}
    manifests = sorted(name for name in sizes if name.startswith(MANIFEST_PREFIX))
    if not sizes:
        return ["the directory is missing or empty"]
    if not manifests:
        return []
    try:
        world = int(json.loads((checkpoint / STATE_FILE).read_text())["world_size"])
        listed = [json.loads((checkpoint / name).read_text())["files"] for name in manifests]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{STATE_FILE} or a manifest is unreadable ({err})"]
    missing = sorted(set(map(manifest_name, range(world))) - set(manifests))
    found = [f"no manifest of {len(missing)} of its {world} ranks ({', '.join(missing)})"] if missing else []
    records = [(name, recorded) for files in listed for name, recorded in files.items()]
    for name, recorded in records:
        if sizes.get(name) is None:
            found.append(f"{name} is missing")
        elif sizes[name] != recorded["size"]:
            found.append(f"{name} has {sizes[name]} bytes, {recorded['size']} were written")
    whole = [(name, recorded) for name, recorded in records if sizes.get(name) == recorded["size"]]
    found += [f"{name}'s SHA-256 differs from the one recorded when it was written"
              for name in _altered(filesystem, root, whole)]
    return found


def _altered(filesystem: Any, root: str, records: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The files of `records` ((name, manifest record) pairs, sizes already checked) whose digests differ
    from their record's: piece by piece in parallel (each file and piece size hashed once); a whole-file
    "sha256" in one stream."""
    pieced = {}
    for name, recorded in records:
        if "sha256_pieces" in recorded:
            pieced.setdefault(recorded["piece_bytes"], {})[name] = recorded["size"]
    digests = {piece_bytes: piece_digests(files, lambda name: filesystem.open_input_file(f"{root}/{name}"),
                                          piece_bytes) for piece_bytes, files in pieced.items()}
    altered = []
    for name, recorded in records:
        if "sha256_pieces" in recorded:
            same = digests[recorded["piece_bytes"]][name] == recorded["sha256_pieces"]
        else:
            with filesystem.open_input_stream(f"{root}/{name}") as stream:
                same = _sha256(stream) == recorded["sha256"]
        if not same:
            altered.append(name)
    return altered
