"""Arguments shared by the commands: --config, repeated --set overrides, --json."""

from __future__ import annotations

import argparse

from app.config import SkrullConfig, load_config


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument(
        "--config", required=required, default=None,
        help="run config YAML (a path, or relative to configs/)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="dotted override, repeatable: --set scheduling.bucket_size=26000",
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def config_from_args(args: argparse.Namespace, *, derive_bucket_size: bool = True) -> SkrullConfig:
    """The config of --config and --set; scheduling.bucket_size=auto derived from memory
    (app/profiling/memory.py) unless the caller derives it itself (`plan`, `train`: they print it)."""
    config = load_config(args.config, args.overrides)
    if derive_bucket_size:
        from app.profiling.memory import resolve_bucket_size

        config, _ = resolve_bucket_size(config)
    return config
