"""A run never loses its last good state: checkpoints verified before a resume, storage errors in one line.

Unit (no Ray): the manifests every rank writes (workers/checkpoint_files.py) catch a truncated or altered
file and a missing rank; the driver sets a bad newest checkpoint aside so that Ray Train's own reader
(`Result.from_path`, what a resume reads) names the older one, and refuses with exit 2 when none loads
(app/rundir/resume_checkpoints.py); a storage OSError buried in Ray's wrappers becomes one line naming
run.storage_path and the free space (workers/storage_errors.py, app/rundir/files.py).

End to end (slow, two Ray runs): a tiny run whose run.storage_path is a 7 MiB tmpfs (two checkpoints of
~2.8 MB fit, the third does not) stops at step 3 with one error naming run.storage_path and the free space,
and no partial checkpoint stays. Where mounting is impossible (not root), a read-only leftover directory of
step 3's checkpoint makes the same write fail with EACCES instead. The run is then copied to roomy storage,
one optimizer shard of its newest checkpoint (step 2) is truncated, and a rerun with more steps warns
naming that checkpoint, resumes from step 1, and re-trains steps 2 and 3 to the first run's losses.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from tests.run_configs import NO_EXPORT, SMALL_VOCAB
from workers.checkpoint_files import manifest_name, problems, write_manifest
from workers.storage import Location

# ----------------------------------------------------------------------------- manifests (unit)


def checkpoint_name(step: int) -> str:
    """A checkpoint directory name of the unit tests' runs (Ray Train's are checkpoint_<time>)."""
    return f"checkpoint_step{step}"


def _checkpoint(root: Path, step: int, world: int = 2) -> Path:
    """A checkpoint directory as the ranks leave it: each rank's files and manifest, rank 0's state."""
    final = root / checkpoint_name(step)
    for rank in range(world):
        tmp = root / f"tmp-{step}-{rank}"
        (tmp / f"step{step}").mkdir(parents=True)
        (tmp / f"step{step}" / f"optim_rank{rank}.pt").write_bytes(os.urandom(1000 + rank))
        if rank == 0:
            (tmp / "skrull_state.json").write_text(json.dumps({"step": step, "world_size": world}))
        write_manifest(tmp, rank)
        shutil.copytree(tmp, final, dirs_exist_ok=True)
        shutil.rmtree(tmp)
    return final


def test_manifests_catch_truncation_alteration_and_a_missing_rank(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, 4)
    assert problems(Location.of(ckpt)) == []
    shard = ckpt / "step4" / "optim_rank1.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[:500])
    assert problems(Location.of(ckpt)) == ["step4/optim_rank1.pt has 500 bytes, 1001 were written"]
    shard.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    assert problems(Location.of(ckpt)) == ["step4/optim_rank1.pt's SHA-256 differs from the one recorded "
                                           "when it was written"]
    shard.write_bytes(data)
    (ckpt / manifest_name(1)).unlink()
    assert problems(Location.of(ckpt)) == [f"no manifest of 1 of its 2 ranks ({manifest_name(1)})"]
    (ckpt / manifest_name(0)).unlink()  # a checkpoint from before manifests existed: nothing to check
    assert problems(Location.of(ckpt)) == []
    assert problems(Location.of(tmp_path / "nowhere")) == ["the directory is missing or empty"]


def test_a_manifest_hashes_a_file_piece_by_piece_and_catches_a_change_in_any_piece(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Each piece's digest is hashlib's SHA-256 of that slice of the file (pieces of 1,000 bytes here, 256
    MiB in a run), and a byte changed in a middle piece or in the short last one is caught."""
    import hashlib

    import workers.checkpoint_files

    monkeypatch.setattr(workers.checkpoint_files, "PIECE_BYTES", 1000)
    (tmp_path / "step3").mkdir()
    (shard := tmp_path / "step3" / "optim.pt").write_bytes(data := os.urandom(3500))
    (tmp_path / "skrull_state.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    write_manifest(tmp_path, 0)
    record = json.loads((tmp_path / manifest_name(0)).read_text())["files"]["step3/optim.pt"]
    pieces = [hashlib.sha256(data[i:i + 1000]).hexdigest() for i in (0, 1000, 2000, 3000)]
    assert record == {"size": 3500, "piece_bytes": 1000, "sha256_pieces": pieces}
    assert problems(Location.of(tmp_path)) == []
    for offset in (1500, 3499):
        shard.write_bytes(data[:offset] + bytes([data[offset] ^ 1]) + data[offset + 1:])
        assert problems(Location.of(tmp_path)) == ["step3/optim.pt's SHA-256 differs from the one recorded "
                                                   "when it was written"]
    shard.write_bytes(data)
    assert problems(Location.of(tmp_path)) == []


def test_a_manifest_of_whole_file_digests_still_verifies(tmp_path: Path) -> None:
    """Checkpoints written before the pieces record one SHA-256 of each whole file: they still resume, and
    an altered file is still caught."""
    import hashlib

    ckpt = _checkpoint(tmp_path, 5)
    for rank in range(2):
        manifest = json.loads((ckpt / manifest_name(rank)).read_text())
        manifest["files"] = {name: {"size": (ckpt / name).stat().st_size,
                                    "sha256": hashlib.sha256((ckpt / name).read_bytes()).hexdigest()}
                             for name in manifest["files"]}
        (ckpt / manifest_name(rank)).write_text(json.dumps(manifest))
    assert problems(Location.of(ckpt)) == []
    shard = ckpt / "step5" / "optim_rank0.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert problems(Location.of(ckpt)) == ["step5/optim_rank0.pt's SHA-256 differs from the one recorded "
                                           "when it was written"]


def _save_with_temp_room(rank: int, world: int, run_dir: str, temp: str, free: int | None) -> dict:
    """One gloo rank: a bf16 one-rank engine (BF16_Optimizer, its AdamW state allocated by the warm-up)
    saved by save_checkpoint into `run_dir`, with its temporary directory in `temp` and, when `free` is
    given, that directory's free space reported as `free` bytes. Ray Train's storage context is a stand-in
    naming the checkpoint checkpoint_room."""
    import shutil
    import tempfile
    from types import SimpleNamespace

    import ray.train
    import torch
    from pyarrow import fs

    import workers.checkpoint_files as files
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config
    from tests.test_fast_step import SPEC
    from workers.checkpoints import CheckpointState
    from workers.distributed import ParallelGroups
    from workers.engine import build_engine
    from workers.models import ModelSpec
    from workers.warmup import warm_up

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    groups = ParallelGroups.create(world)
    config = load_config(None, ["train.optimizer_impl=fused"])
    ds = deepspeed_config(config.train, dtype="bf16", on_gpu=False, hidden_size=SPEC["hidden_size"])
    engine = build_engine(ModelSpec(**SPEC, dtype="bf16"), ds, torch.device("cpu"), seed=0)
    warm_up(engine, groups, torch.device("cpu"), tokens=48, loss_chunk_tokens=16)
    storage = SimpleNamespace(make_default_checkpoint_dir_name=lambda: "checkpoint_room",
                              storage_filesystem=fs.LocalFileSystem(),
                              build_checkpoint_path_from_name=lambda name: f"{run_dir}/{name}")
    ray.train.get_context = lambda: SimpleNamespace(get_storage=lambda: storage)
    tempfile.tempdir = temp
    if free is not None:
        usage = shutil.disk_usage(temp)
        files.shutil = SimpleNamespace(disk_usage=lambda _: usage._replace(free=free))
    state = CheckpointState(step=3, epoch=0, rows=12, tag="step3", world_size=1, dp_size=1, cp_size=1)
    saved = files.save_checkpoint(engine, state, groups.world_group, run_dir)
    lora = build_engine(ModelSpec(**SPEC, dtype="bf16", lora_r=4), ds, torch.device("cpu"), seed=0)
    warm_up(lora, groups, torch.device("cpu"), tokens=48, loss_chunk_tokens=16)
    weights = [(p.numel() * p.element_size(), p.requires_grad) for p in lora.module.parameters()]
    return {"failure": saved.failure, "estimate": files.shard_bytes(engine), "lora": files.shard_bytes(lora),
            "lora_trained": sum(n for n, trained in weights if trained),
            "lora_frozen": sum(n for n, trained in weights if not trained)}


def test_a_shard_that_does_not_fit_the_temporary_directory_stops_before_saving(tmp_path: Path) -> None:
    """save_checkpoint estimates this rank's shard (the masters, AdamW's state and the module's weights)
    and compares it with the free space where DeepSpeed writes it first (TMPDIR): a shard that fits is
    written, and its files hold about the estimate; one that does not stops every rank before DeepSpeed's
    save (whose barriers a rank that failed inside it would never reach) with one line naming TMPDIR."""
    from workers.tools.launch import run_workers

    temp = tmp_path / "temp"
    temp.mkdir()
    fits = run_workers(_save_with_temp_room, 1, args=(str(tmp_path / "run"), str(temp), None),
                       backend="gloo")[0]
    assert fits["failure"] is None
    written = sum(p.stat().st_size for p in (tmp_path / "run" / "checkpoint_room" / "step3").iterdir())
    assert fits["estimate"] <= written <= 1.1 * fits["estimate"], (fits["estimate"], written)
    assert problems(Location.of(tmp_path / "run" / "checkpoint_room")) == []
    # LoRA: the adapters' weights (bf16) with their masters and AdamW's two moments (fp32 each: 14 bytes per
    # weight in all) and step counters, not the frozen base, which save_checkpoint leaves out
    adapters = 7 * fits["lora_trained"]
    assert adapters <= fits["lora"] <= adapters + 64 and fits["lora_frozen"] > 64, fits
    short = run_workers(_save_with_temp_room, 1, args=(str(tmp_path / "run2"), str(temp), 4096),
                        backend="gloo")[0]
    assert short["failure"] == (
        f"writing checkpoint_room (step 3): the temporary directory each rank writes its shard into before "
        f"it moves into run.storage_path is too small on rank(s) 0 ({temp} has 0.0 MiB free, this rank's "
        f"shard needs about {short['estimate'] / 2**20:,.1f} MiB). Set TMPDIR in the workers' environment "
        f"(where Ray starts on each node, or the job's runtime_env) to a directory on a larger disk and "
        f"rerun the same command to resume from the newest complete checkpoint")
    assert not (tmp_path / "run2").exists() and list(temp.iterdir()) == []


# ------------------------------------------------------------------ choosing what to resume (unit)


def _run_with_checkpoints(run: Path, steps: list[int]) -> None:
    """A run directory whose Ray Train snapshot records `steps` (oldest first), as its controller writes."""
    results = [{"version": 0, "checkpoint_dir_name": _checkpoint(run, s).name, "metrics": {"step": s}}
               for s in steps]
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps({
        "ray_version": __import__("ray").__version__, "checkpoint_results": results,
        "checkpoint_report_indices": [2 * i + 1 for i in range(len(steps))],
        "latest_checkpoint_result": results[-1], "pending_training_results": [],
        "pending_validation_specs": [], "current_report_index": 2 * len(steps),
        "validated_checkpoint_dir_names": [], "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": []}))


def _truncate_a_shard(checkpoint: Path) -> None:
    shard = next(checkpoint.glob("step*/optim_rank1.pt"))
    shard.write_bytes(shard.read_bytes()[:10])


def test_a_bad_newest_checkpoint_is_set_aside_and_ray_train_resumes_the_older_one(tmp_path: Path) -> None:
    from ray.train import Result

    from app.rundir.resume_checkpoints import set_aside_unloadable_checkpoints
    from app.rundir.snapshot import recorded_step

    run = tmp_path / "run"
    _run_with_checkpoints(run, [2, 4, 6])
    _truncate_a_shard(run / checkpoint_name(6))
    out = io.StringIO()
    set_aside_unloadable_checkpoints(run, out=out)
    assert out.getvalue() == (
        f"warning: run 'run': checkpoint {checkpoint_name(6)} (step 6) does not load (step6/optim_rank1.pt "
        f"has 10 bytes, 1001 were written); set aside as checkpoint-corrupt-{checkpoint_name(6)}, resuming "
        f"from {checkpoint_name(4)} (step 4)\n")
    assert not (run / checkpoint_name(6)).exists()
    assert (run / f"checkpoint-corrupt-{checkpoint_name(6)}").is_dir()
    # Ray Train's own reader of the snapshot (what a resume and `export` read) now names step 4.
    assert Path(Result.from_path(str(run)).checkpoint.path).name == checkpoint_name(4)
    assert recorded_step(run) == 4
    set_aside_unloadable_checkpoints(run, out=out)  # nothing left to set aside: a no-op
    assert out.getvalue().count("\n") == 1


def test_when_no_checkpoint_loads_the_run_is_refused_before_ray_naming_them(tmp_path: Path, capsys) -> None:
    from app.__main__ import main

    run = tmp_path / "broken"
    _run_with_checkpoints(run, [2, 4])
    for step in (2, 4):
        _truncate_a_shard(run / checkpoint_name(step))
    snapshot = (run / "checkpoint_manager_snapshot.json").read_text()
    args = ["train", "--config", "configs/tiny-cpu.yaml", "--set", f"run.storage_path={tmp_path}",
            "--set", "run.name=broken", "--set", SMALL_VOCAB, "--set", "train.steps=8"]
    assert main(args) == 2  # ray.init is refused in this tier: decided before Ray starts
    err = capsys.readouterr().err
    assert err.startswith("skrull train: error: run 'broken': none of its checkpoints loads: ")
    for name in (checkpoint_name(2), checkpoint_name(4), "checkpoint_manager_snapshot.json",
                 "another run.name"):
        assert name in err
    assert (run / "checkpoint_manager_snapshot.json").read_text() == snapshot  # nothing changed


# ----------------------------------------------------------------------- storage errors (unit)


def test_a_storage_error_inside_rays_wrappers_is_one_line_naming_the_storage_path(tmp_path: Path) -> None:
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from app.train.failures import storage_failure

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "samples.jsonl"))
    wrapped = WorkerGroupError("rank 0 failed", {0: UserExceptionWithTraceback(full, "Traceback ...")})
    failure = storage_failure(wrapped, str(tmp_path))
    assert failure is not None
    message = str(failure)
    assert message.startswith(f"run.storage_path={tmp_path}: a write into the run's storage failed (No space "
                              f"left on device: {tmp_path / 'run' / 'samples.jsonl'}; ")
    assert " MiB free)" in message and "rerun the same command to resume" in message
    assert storage_failure(WorkerGroupError("x", {0: ValueError("a bug")}), str(tmp_path)) is None
    try:
        raise ConfigError("run.storage_path='x' is not writable") from None
    except ConfigError as hidden:  # `from None` hides its cause: a ConfigError stays a ConfigError
        assert storage_failure(hidden, str(tmp_path)) is None


def test_a_run_file_append_that_fails_midway_leaves_no_torn_line(tmp_path: Path, monkeypatch) -> None:
    """A full disk takes half of a metrics.jsonl line: the file is cut back to its last whole line."""
    from app.rundir.files import METRICS_FILE, append_jsonl, read_jsonl

    path = tmp_path / METRICS_FILE
    append_jsonl(path, {"step": 1, "loss": 2.0})
    real_open = Path.open

    class HalfWriter:
        def __init__(self, stream) -> None:
            self.stream = stream

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.stream.close()

        def write(self, text: str) -> int:
            self.stream.write(text[: len(text) // 2])
            self.stream.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "open", lambda self, *a, **k: HalfWriter(real_open(self, *a, **k)))
    with pytest.raises(OSError):
        append_jsonl(path, {"step": 2, "loss": 1.5})
    monkeypatch.undo()
    append_jsonl(path, {"step": 3, "loss": 1.0})  # space again: the file goes on whole
    assert read_jsonl(path) == [{"step": 1, "loss": 2.0}, {"step": 3, "loss": 1.0}]


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[bool]:
    """A tmpfs of `size` mounted at `path` (True), or just the directory where mounting is impossible."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, check=False).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_copy_into_a_full_filesystem_raises_enospc(tmp_path: Path) -> None:
    """The copy a rank makes of its shard (workers/checkpoint_files.copy_into) on a 1 MiB filesystem: refused
    before it writes a byte (check_room), so it never fills the disk under the run's other writers."""
    from pyarrow import fs

    from workers.checkpoint_files import copy_into

    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "big.pt").write_bytes(os.urandom(2 << 20))
    with small_filesystem(tmp_path / "small", "1m") as mounted:
        if not mounted:
            (tmp_path / "small").chmod(stat.S_IRUSR | stat.S_IXUSR)  # not root: permission instead
        with pytest.raises(OSError) as caught:
            copy_into(tmp_path / "shard", fs.LocalFileSystem(), str(tmp_path / "small" / "ckpt"))
        assert caught.value.errno == (errno.ENOSPC if mounted else errno.EACCES)
        if mounted:  # refused before writing: the disk stays free for the run's other writes
            assert not any((tmp_path / "small").rglob("*")), list((tmp_path / "small").rglob("*"))
        (tmp_path / "small").chmod(0o755)


def test_copy_into_the_same_filesystem_renames_every_file_into_place(tmp_path: Path) -> None:
    """A shard on the run's own filesystem moves without copying its bytes: the same inodes land below the
    target, nested paths kept, and an existing target directory (another rank's files) is kept too."""
    from pyarrow import fs

    from workers.checkpoint_files import copy_into

    shard = tmp_path / "shard"
    (shard / "step1").mkdir(parents=True)
    files = {"latest": b"step1", "step1/optim.pt": os.urandom(1 << 16)}
    for name, data in files.items():
        (shard / name).write_bytes(data)
    inodes = {name: (shard / name).stat().st_ino for name in files}
    target = tmp_path / "run" / "checkpoint_x"
    (target / "step1").mkdir(parents=True)
    (target / "step1" / "other_rank.pt").write_bytes(b"kept")
    copy_into(shard, fs.LocalFileSystem(), str(target))
    for name, data in files.items():
        assert (target / name).read_bytes() == data and (target / name).stat().st_ino == inodes[name]
    assert (target / "step1" / "other_rank.pt").read_bytes() == b"kept"
    assert not any(p.is_file() for p in shard.rglob("*"))


# ------------------------------------------------------------------------- end to end (slow, Ray)

OVERRIDES = ["run.name=full", "data.num_samples=40", "data.length_scale=0.1",
             "scheduling.global_batch_size=8", "parallel.cp_size=1", "parallel.num_workers=2", SMALL_VOCAB,
             "train.checkpoint_every=1", "train.steps=4", NO_EXPORT]
SMALL = "7m"
"""Two checkpoints of this tiny run (~2.8 MB each: model states, two optimizer shards) and its run files fit;
a third does not, while Ray Train still keeps the first two (it deletes beyond train.keep_checkpoints=2 only
after registering the new one)."""


def _config(storage: Path):
    return load_config("configs/tiny-cpu.yaml", [f"run.storage_path={storage}", *OVERRIDES])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _samples(run_dir: Path) -> dict[tuple[int, int], list[int]]:
    lines = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    keyed = {(line["step"], line["dp_rank"]): line["sample_ids"] for line in lines}
    assert len(keyed) == len(lines), "a step written twice"
    return keyed


def _checkpoints(run_dir: Path) -> dict[int, str]:
    """step -> checkpoint directory name, of the run's checkpoint_* directories."""
    return {json.loads((p / "skrull_state.json").read_text())["step"]: p.name
            for p in run_dir.glob("checkpoint_*") if p.is_dir()}


def _in_a_user_namespace(storage: Path, copy: Path) -> tuple[str, list[str]]:
    """Not root: the same run through `python -m app train` in a user + mount namespace of its own, where
    mounting a tmpfs is allowed (its own embedded Ray); returns (its error, the run directory's listing)."""
    command = [sys.executable, "-m", "app", "train", "--config", "configs/tiny-cpu.yaml", "--no-progress",
               *(part for o in [f"run.storage_path={storage}", *OVERRIDES] for part in ("--set", o))]
    script = (f'mount -t tmpfs -o size={SMALL} tmpfs "$0" || exit 99; "$@"; rc=$?; '
              'ls -a "$0/full" >&2; cp -a "$0/full" "$COPY"; exit $rc')
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"COPY": str(copy)}
    storage.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script,
                           str(storage), *command],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 1, f"no tmpfs could be mounted even in a user namespace: {done.stderr[-2000:]}"
    errors = [line for line in done.stderr.splitlines() if line.startswith("skrull train: error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    listing = [line for line in done.stderr.splitlines() if line.startswith(("checkpoint", "metrics"))]
    return errors[0].removeprefix("skrull train: error: "), listing


@pytest.fixture(scope="module")
def full_disk(local_ray, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[str], Path]:
    """The run on a 7 MiB filesystem, stopped at step 3: (storage, its error, the run directory's listing,
    a copy of the run directory on roomy storage, made while the small filesystem was still there)."""
    from app.train.driver import train
    from app.train.failures import RunFailed

    root = tmp_path_factory.mktemp("full_disk")
    storage, copy = root / "small", root / "roomy" / "full"
    copy.parent.mkdir()
    with small_filesystem(storage, SMALL) as mounted:
        if mounted:
            with pytest.raises(RunFailed) as failed:
                train(_config(storage), progress=False)
            message, listing = str(failed.value), sorted(p.name for p in (storage / "full").iterdir())
            shutil.copytree(storage / "full", copy)
    if not mounted:
        message, listing = _in_a_user_namespace(storage, copy)
    return storage, message, listing, copy


def test_a_full_disk_is_one_error_naming_the_storage_path_and_no_partial_checkpoint_stays(full_disk) -> None:
    from app.rundir.snapshot import recorded_step

    storage, message, listing, copy = full_disk
    assert message.startswith(f"run.storage_path={storage}: writing checkpoint_"), message
    assert "(step 3) on rank" in message and "No space left on device" in message, message
    assert " MiB free)" in message and "rerun the same command to resume" in message, message
    assert message.endswith(" was removed"), message
    checkpoints = _checkpoints(copy)
    assert sorted(checkpoints) == [1, 2]  # step 3's partial directory is gone
    assert sorted(name for name in listing if name.startswith("checkpoint_2")) == sorted(checkpoints.values())
    assert recorded_step(copy) == 2  # step 3's checkpoint never became the newest
    # The run's files stay whole: strict JSON, step 3 reported as the one that stopped the run.
    records = _records(copy)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["stopped"] == message
    assert sorted({step for step, _ in _samples(copy)}) == [1, 2, 3]


def test_a_truncated_newest_checkpoint_is_skipped_and_the_older_one_resumed(full_disk, capsys) -> None:
    """The copied run: step 2's checkpoint loses most of one optimizer shard; a rerun resumes step 1's."""
    from app.train.driver import train

    run_dir = full_disk[3]
    first = {r["step"]: r["loss"] for r in _records(run_dir)}
    first_samples = _samples(run_dir)
    names = _checkpoints(run_dir)
    shard = run_dir / names[2] / "step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:size // 3])
    summary = train(_config(run_dir.parent), progress=False)
    warning = (f"warning: run 'full': checkpoint {names[2]} (step 2) does not load (step2/"
               f"zero_pp_rank_1_mp_rank_00_optim_states.pt has {size // 3} bytes, {size} were written); set "
               f"aside as checkpoint-corrupt-{names[2]}, resuming from {names[1]} (step 1)")
    assert warning in capsys.readouterr().err
    assert summary.resumed_from_step == 1 and [h["step"] for h in summary.history] == [2, 3, 4]
    # Steps 2 and 3 re-trained from step 1's state give the first run's losses (fp32, summation order).
    assert summary.losses[:2] == pytest.approx([first[2], first[3]], rel=1e-4)
    samples = _samples(run_dir)  # cut back to step 1, then steps 2-4 once each, the same ids as before
    assert sorted({step for step, _ in samples}) == [1, 2, 3, 4]
    assert all(samples[key] == ids for key, ids in first_samples.items())
    assert sorted(_checkpoints(run_dir)) == [3, 4]  # train.keep_checkpoints=2 over the recorded ones
    assert (run_dir / f"checkpoint-corrupt-{names[2]}").is_dir()
