"""Resume from a checkpoint that loads: the driver verifies a run's recorded checkpoints before Ray starts.

Ray Train resumes the checkpoint its controller recorded as the newest in
<run_dir>/checkpoint_manager_snapshot.json (`latest_checkpoint_result`: what `ray.train.get_checkpoint()`
returns; it offers no other). So before Ray starts the driver verifies the recorded checkpoints newest
first against the manifests their ranks wrote (workers/checkpoint_files.py: every rank's manifest present,
every file with its recorded size and SHA-256) and stops at the first that passes. Each newer one that
failed is set aside:

    dropped from the snapshot (its entry, its report index, pending/validation lists), whose
    `latest_checkpoint_result` then names the newest checkpoint that passed, and
    moved to checkpoint-corrupt-<name> (kept for inspection; Ray Train never sees it again; on an object
    store, which cannot rename a directory, left where it is until a save of the same step replaces it),

with one warning line each. Ray Train then resumes the older checkpoint like any other: the workers cut
samples.jsonl back to its step and restart the planner from its data cursor (workers/train_loop.py), and
train.keep_checkpoints retention goes on over the recorded checkpoints that remain. A recorded directory
that no longer exists is dropped too (Ray Train refuses a snapshot naming a missing checkpoint).

When no recorded checkpoint passes, nothing is changed and a ConfigError (exit 2) names every checkpoint
directory and how to start over. Cost: reading the newest checkpoint once (hashing, ~1 GB/s locally; one
download on an object store). The snapshot's format is Ray Train's (ray/train/v2/_internal/execution/
checkpoint/checkpoint_manager.py, _CheckpointManagerState); only the fields named above are touched.
The caller holds the run (nobody else writes it) while this runs.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from app.config import ConfigError
from workers.checkpoint_files import problems
from workers.storage import Location

SNAPSHOT = "checkpoint_manager_snapshot.json"
CORRUPT_PREFIX = "checkpoint-corrupt-"


def set_aside_unloadable_checkpoints(run: str | Location, out: TextIO | None = None) -> None:
    """Make the newest recorded checkpoint of `run` one that passes verification (module docstring)."""
    run = Location.of(run)
    try:
        snapshot = json.loads((run / SNAPSHOT).read_text())
        results, indices = snapshot["checkpoint_results"], snapshot["checkpoint_report_indices"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no snapshot (a fresh run), or one Ray Train itself will report on
    if not results:
        return
    bad = {r["checkpoint_dir_name"]: "the directory is missing" for r in results
           if not (run / r["checkpoint_dir_name"]).exists()}
    newest_first = sorted(range(len(results)), key=lambda i: indices[i], reverse=True)
    good = None
    for i in newest_first:
        name = results[i]["checkpoint_dir_name"]
        found = bad.get(name) or "; ".join(problems(run / name))
        if not found:
            good = i
            break
        bad[name] = found
    if good is None:
        raise ConfigError(_none_loads(run, results, bad))
    if bad:
        moved = _drop_from_snapshot(run, snapshot, set(bad))
        _announce(run, results, bad, moved, results[good], out or sys.stderr)


def _step(result: dict[str, Any]) -> str:
    return str(result.get("metrics", {}).get("step", "?"))


def _none_loads(run: Location, results: list[dict[str, Any]], bad: dict[str, str]) -> str:
    listed = "; ".join(f"{r['checkpoint_dir_name']} (step {_step(r)}): {bad[r['checkpoint_dir_name']]}"
                       for r in results)
    return (f"run {run.name!r}: none of its checkpoints loads: {listed}. To start the run over, remove "
            f"{run / SNAPSHOT} and those directories (or the whole run directory {run}), or use another "
            "run.name")


def _drop_from_snapshot(run: Location, snapshot: dict[str, Any], bad: set[str]) -> set[str]:
    """Rewrite the snapshot without the `bad` checkpoints (atomically), then move their directories aside
    (returns the names moved)."""
    results, indices = snapshot["checkpoint_results"], snapshot["checkpoint_report_indices"]
    keep = [i for i, r in enumerate(results) if r["checkpoint_dir_name"] not in bad]
    snapshot["checkpoint_results"] = [results[i] for i in keep]
    snapshot["checkpoint_report_indices"] = [indices[i] for i in keep]
    snapshot["latest_checkpoint_result"] = results[max(keep, key=lambda i: indices[i])]
    pending = list(zip(snapshot.get("pending_training_results", []),
                       snapshot.get("pending_validation_specs", []), strict=True))
    pending = [(r, spec) for r, spec in pending if r["checkpoint_dir_name"] not in bad]
    snapshot["pending_training_results"] = [r for r, _ in pending]
    snapshot["pending_validation_specs"] = [spec for _, spec in pending]
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        snapshot[key] = [name for name in snapshot.get(key, []) if name not in bad]
    (run / SNAPSHOT).write_text(json.dumps(snapshot))
    # Object stores have no directory rename (a copy of every object): a set-aside checkpoint stays where it
    # is there, unrecorded, until a save of the same step replaces it.
    moved = {name for name in bad if run.is_local and (run / name).exists()}
    for name in moved:
        aside = run / f"{CORRUPT_PREFIX}{name}"
        aside.delete()  # an earlier set-aside copy of the same step
        aside.filesystem.move((run / name).path, aside.path)
    return moved


def _announce(run: Location, results: list[dict[str, Any]], bad: dict[str, str], moved: set[str],
              good: dict[str, Any], out: TextIO) -> None:
    for result in results:
        name = result["checkpoint_dir_name"]
        if name in bad:
            aside = f"set aside as {CORRUPT_PREFIX}{name}" if name in moved else "no longer recorded"
            print(f"warning: run {run.name!r}: checkpoint {name} (step {_step(result)}) does not load "
                  f"({bad[name]}); {aside}, resuming from {good['checkpoint_dir_name']} (step {_step(good)})",
                  file=out, flush=True)
