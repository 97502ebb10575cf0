"""What a run started with, and the check that a rerun may resume it.

    <run_dir>/skrull_config.json   the config (URIs redacted)                    CONFIG_SNAPSHOT
    <run_dir>/skrull_data.json     the data fingerprints (app/data/fingerprint)  DATA_SNAPSHOT
    <run_dir>/chat_template.jinja  the chat template the run rendered with       TEMPLATE_SNAPSHOT

A rerun that resumes a checkpoint must compute the same math: every config key marked MATH
(app/config.py math_keys) and every dataset's fingerprint must equal the snapshot's, unless
train.allow_config_change. Every file is written whole (workers/storage.py Location.write_text).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.config import ConfigError, SkrullConfig, math_keys
from app.rundir.files import CONFIG_SNAPSHOT, DATA_SNAPSHOT, TEMPLATE_SNAPSHOT
from workers.storage import Location, redact_uri

LEGACY_VALUES: dict[str, Any] = {"data.shuffle": False, "data.format_type": "auto", "data.add_eos": False}
"""What a run snapshotted before a key existed did, where that differs from the key's default: it read its
file data in stream order, and appended no EOS to `text` rows."""
LEGACY_RENAMES: dict[tuple[str, bool], str] = {("data.chat_template", True): "chatml",
                                               ("data.chat_template", False): "none"}
"""data.chat_template was a bool: true rendered ChatML, false plain text."""


def _dotted(tree: dict[str, Any], key: str) -> Any:
    """The value at a dotted key of a config dict (nested sections: model.lora.r), or None when absent."""
    node: Any = tree
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def recorded_step(run_dir: str | Path | Location) -> int:
    """The step of the newest checkpoint Ray Train recorded for the run (what a rerun resumes), or 0.

    Ray Train's controller records a checkpoint in this snapshot once every worker has reported it; a
    checkpoint directory not recorded there (the driver stopped first) is never resumed from.
    """
    try:
        snapshot = json.loads((Location.of(run_dir) / "checkpoint_manager_snapshot.json").read_text())
        return max((int(r["metrics"]["step"]) for r in snapshot["checkpoint_results"]), default=0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def check_resume(config: SkrullConfig, run_dir: str | Path | Location,
                 data: dict[str, Any] | None = None) -> bool:
    """Whether this call resumes a checkpoint of the run (False: it starts fresh).

    A finished run is not rerun. A run without a complete checkpoint has nothing to resume: it starts
    fresh with this config, whatever its snapshot says (a start that failed before its first checkpoint
    must not block its own fix). Resuming a checkpoint, one ConfigError lists every math key that differs
    from the run's snapshot, and with `data` (this call's data fingerprints, ResolvedData.fingerprints)
    every dataset whose files differ from those the run started with (DATA_SNAPSHOT), unless
    train.allow_config_change.
    """
    run_dir = Location.of(run_dir)
    done = recorded_step(run_dir)
    if config.train.steps and done >= config.train.steps:
        raise ConfigError(f"run {run_dir.name!r} already trained {done} steps (train.steps="
                          f"{config.train.steps}); raise train.steps to train it further, or use another "
                          "run.name")
    snapshot = run_dir / CONFIG_SNAPSHOT
    if done == 0 or config.train.allow_config_change or not snapshot.exists():
        return done > 0
    changed = _changed_math(json.loads(snapshot.read_text()), snapshot_record(config))
    if data is not None:
        changed += _changed_data(run_dir, data)
    if changed:
        raise ConfigError(
            f"run {run_dir.name!r} exists and resuming it would change its math: {'; '.join(changed)}. "
            "Use another run.name, or --set train.allow_config_change=true to resume anyway"
        )
    return True


def _changed_math(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every math key that differs (URIs compared redacted: snapshots hold them so)."""
    defaults = SkrullConfig().to_dict()  # a run snapshotted before a key existed ran with its default

    def value(tree: dict[str, Any], key: str) -> Any:
        found = _dotted(tree, key)
        if found is None:
            found = LEGACY_VALUES[key] if key in LEGACY_VALUES else _dotted(defaults, key)
        found = LEGACY_RENAMES.get((key, found), found) if isinstance(found, bool) else found
        found = list(found) if isinstance(found, tuple) else found  # the JSON snapshot holds lists
        return redact_uri(found) if isinstance(found, str) else found

    changed = []
    for key in math_keys():
        old, new = value(before, key), value(now, key)
        if key == "data.sources":
            changed += _changed_sources(old or [], new or [])
        elif old != new:
            changed.append(f"{key}: {old!r} -> {new!r}")
    return changed


def _changed_sources(before: list[Any], now: list[Any]) -> list[str]:
    """`data.sources[i].key: old -> new` for every key of an entry that differs (entries compared as the
    JSON snapshot holds them); an entry added or removed: the ids before and now."""
    before, now = (json.loads(json.dumps(_redacted(side))) for side in (before, now))
    if len(before) != len(now):
        ids = [[entry.get("id") or entry.get("path") for entry in side] for side in (before, now)]
        return [f"data.sources: {len(before)} entries {ids[0]} -> {len(now)} {ids[1]}"]
    return [f"data.sources[{i}].{key}: {old.get(key)!r} -> {new.get(key)!r}"
            for i, (old, new) in enumerate(zip(before, now, strict=True))
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def _changed_data(run_dir: Location, data: dict[str, Any]) -> list[str]:
    """`data.path: the data changed (...)` for every dataset whose fingerprint differs from the run's."""
    from app.data.fingerprint import describe_change

    recorded = run_dir / DATA_SNAPSHOT
    if not recorded.exists():
        return []  # a run snapshotted before data fingerprints existed: nothing to compare with
    before = json.loads(recorded.read_text())
    return [f"{key}: the data changed ({describe_change(before[key], data[key])})" for key in data
            if key in before and before[key] != data[key]]


def snapshot_record(config: SkrullConfig) -> dict[str, Any]:
    """The config as the snapshot holds it: every URI without its secrets (redact_uri)."""
    return _redacted(config.to_dict())


def _redacted(node: Any) -> Any:
    """Every string of a config tree (dicts, lists: data.sources' entries) without a URI's secrets."""
    if isinstance(node, dict):
        return {key: _redacted(value) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return [_redacted(value) for value in node]
    return redact_uri(node) if isinstance(node, str) else node


def write_snapshot(config: SkrullConfig, run_dir: str | Path | Location, *, template: str | None,
                   data: dict[str, Any] | None = None, fresh: bool = True) -> bool:
    """Record the config, the chat `template` text (None: data.chat_template=none) and `data` (the data
    fingerprints) of a run that starts fresh; a resumed run (`fresh=False`) keeps the first ones. Each
    file is written whole.

    The template is recorded so that `export` ships exactly it even when the Jinja file or the tokenizer's
    template changed since. Returns True when a different snapshot of an earlier call was replaced (a run
    that never reached a checkpoint, started again).
    """
    run_dir = Location.of(run_dir)
    snapshot, record = run_dir / CONFIG_SNAPSHOT, snapshot_record(config)
    replaced = False
    if not snapshot.exists() or fresh:
        replaced = snapshot.exists() and json.loads(snapshot.read_text()) != record
        snapshot.write_text(json.dumps(record, indent=1))
    if data is not None and (fresh or not (run_dir / DATA_SNAPSHOT).exists()):
        (run_dir / DATA_SNAPSHOT).write_text(json.dumps(data, indent=1))
    target = run_dir / TEMPLATE_SNAPSHOT
    if fresh or not target.exists():
        if template is not None:
            target.write_text(template)
        elif target.exists():
            target.delete()
    return replaced
