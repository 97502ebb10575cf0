"""Checks that run on the driver before Ray starts anything, so bad input fails fast with one message.

The config tree already rejected unknown keys, bad choices and a world size not divisible by CP (its
sections validate themselves, app/config.py); the data scan rejects too-long and unusable data
(app.data.pipeline.scan_dataset).
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from app.config import ConfigError, SkrullConfig
from workers.presets import TINY_PRESETS

# A Hugging Face hub id: "name" or "org/name", no path syntax.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def check_model_source(name_or_path: str) -> None:
    """A tiny preset, an existing local directory, or something shaped like a hub id."""
    if name_or_path in TINY_PRESETS or Path(name_or_path).expanduser().is_dir():
        return
    looks_like_path = name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1
    if looks_like_path or not _HUB_ID.match(name_or_path):
        raise ConfigError(
            f"model.name_or_path={name_or_path!r} is not an existing directory, a hub id (org/name) or a "
            f"preset ({', '.join(TINY_PRESETS)}); fix model.name_or_path"
        )


def run_name(config: SkrullConfig) -> str:
    """run.name, or a fresh timestamped name when it is empty (so the README command can be re-run)."""
    return config.run.name or f"skrull-{datetime.now():%Y%m%d-%H%M%S}"


def run_directory(config: SkrullConfig, name: str) -> Path:
    """<storage_path>/<name>, refusing to append a second run to an existing audit log."""
    run_dir = Path(config.run.storage_path).expanduser().resolve() / name
    if (run_dir / "samples.jsonl").exists():
        raise ConfigError(
            f"run {name!r} already exists in {run_dir.parent} (resuming a run is not supported yet); "
            "choose another run.name, or leave run.name empty for a timestamped one"
        )
    return run_dir


def preflight(config: SkrullConfig) -> None:
    """Model source, data source and tokenizer: everything that can be checked without Ray."""
    from app.data.readers import resolve_source
    from app.data.tokenizer import load_tokenizer

    check_model_source(config.model.name_or_path)
    if config.data.source == "path":
        resolve_source(config.data)
    load_tokenizer(config.data.tokenizer)
