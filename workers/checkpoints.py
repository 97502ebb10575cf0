"""A run's checkpoints: DeepSpeed state + the data cursor, saved through Ray Train, loaded on any world size.

    checkpoint_<time>/                  one Ray Train checkpoint (the newest *complete* one is resumed)
      step<N>/                          DeepSpeed: model, ZeRO-2 optimizer partitions, LR schedule, step
      latest
      skrull_state.json                 {step, epoch, rows, tag, world_size, dp_size, cp_size, spares,
                                         calibration, zero_stage}
      skrull_manifest_rank<R>.json      size and SHA-256 of each file rank R wrote (written, copied and
                                        verified before a resume: workers/checkpoint_files.py)

Resume on the same world size and ZeRO stage loads the DeepSpeed checkpoint as saved. ZeRO-2 partitions
the optimizer state over all W ranks, so a checkpoint saved by W ranks cannot be loaded by W' != W as it
is: the node's first local rank converts it with DeepSpeed's own converter
(`deepspeed.checkpoint.ds_to_universal`, run by workers/tools/ds_to_universal.py; a "universal checkpoint":
one file per parameter and optimizer state) into a node-local directory, and every rank loads that with
`checkpoint.load_universal` set, which re-partitions the state for W' ranks (docs/design.md §10). The same
path takes a checkpoint of another ZeRO stage (one worker runs stage 2 as stage 1, workers/engine.py
for_world_size; in bf16 their files differ).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from workers.storage import Location

STATE_FILE = "skrull_state.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointState:
    """What a checkpoint holds besides DeepSpeed's state: where training and the data stream stood."""

    step: int
    epoch: int
    rows: int
    tag: str
    world_size: int
    dp_size: int
    cp_size: int
    spares: int = 0
    calibration: dict[str, Any] | None = None
    """The planner's online fit when the step was planned (scheduling/refit.py Refit.to_dict, with its
    version): a resumed or resized run plans with it from its first step."""
    zero_stage: int | None = None
    """The ZeRO stage DeepSpeed ran (workers/engine.py for_world_size: stage 2 runs as 1 on one worker);
    None: a checkpoint written before it was recorded, at the config's stage."""

    @property
    def shape(self) -> str:
        extra = f" (+{self.spares} spare)" if self.spares else ""
        return f"DP {self.dp_size} x CP {self.cp_size}{extra}"

    @classmethod
    def read(cls, directory: str | Path) -> CheckpointState:
        return cls(**json.loads(Path(directory, STATE_FILE).read_text()))

    def write(self, directory: str | Path) -> None:
        Path(directory, STATE_FILE).write_text(json.dumps(asdict(self)))


def resume_point(checkpoint: Any) -> CheckpointState | None:
    """The state of Ray Train's newest complete checkpoint of this run, or None (a fresh run)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return CheckpointState.read(directory)


def cut_samples(run_dir: str, last_step: int) -> None:
    """Keep only the samples.jsonl lines of steps the resumed model has trained (atomic replace; a local
    path or a URI, through workers/storage.py)."""
    path = Location.of(run_dir) / "samples.jsonl"
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["step"] <= last_step]
    if len(kept) < len(lines):
        path.write_text("".join(line + "\n" for line in kept))


def universal_dir(checkpoint_path: str, state: CheckpointState) -> Path:
    """Node-local home of one checkpoint's universal conversion (the same path on every rank of a node)."""
    key = hashlib.sha256(f"{checkpoint_path}:{state.tag}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir(), "skrull-universal", key)


@contextmanager
def converting_to_universal(checkpoint_dir: str | Path, state: CheckpointState, out: Path) -> Iterator[None]:
    """Convert `checkpoint_dir/<tag>` into `out/<tag>_universal` with DeepSpeed's converter while the body
    runs; on leaving it, wait for the converter and move its output into place atomically.

    The caller builds its engine in the body: the conversion needs only the checkpoint's files, the engine
    build only the model config, so each hides the other's time (on 2 cores, a 1-worker resume's 11.5 s
    from group start to first step included ~4 s of conversion). The converter runs in a subprocess
    because it is a command-line tool that starts its own process pools (workers/tools/ds_to_universal.py
    runs it without the mlflow import, ~2.5 s less per conversion); `--inject_missing_state` adds the
    version marker a plain (non-Megatron) engine does not save. If the body raises, the converter is
    stopped and nothing is left behind.
    """
    final = out / f"{state.tag}_universal"
    if final.exists():
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="converting-", dir=out))
    command = [sys.executable, "-m", "workers.tools.ds_to_universal",
               "--input_folder", str(Path(checkpoint_dir, state.tag)), "--output_folder", str(staging / "u"),
               "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    # Output to a file, not a pipe: nobody reads a pipe while the body runs, and a full one would stall it.
    with tempfile.TemporaryFile("w+") as output:
        converter = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            yield
        except BaseException:
            converter.kill()
            converter.wait()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if converter.wait() != 0:
            shutil.rmtree(staging, ignore_errors=True)
            output.seek(0)
            raise RuntimeError(f"converting checkpoint {state.tag} ({state.shape}) for a new world size "
                               f"failed:\n{output.read()[-6000:]}")
    os.replace(staging / "u", final)
    shutil.rmtree(staging, ignore_errors=True)
