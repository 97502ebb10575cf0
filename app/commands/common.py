"""Arguments shared by the commands: --config, repeated --set overrides, --json; a summary as a table."""

from __future__ import annotations

import argparse
from typing import Any

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
    """The config of --config and --set; train.activation_checkpointing=auto and scheduling.bucket_size=auto
    resolved (app/profiling/budget.py) unless the caller resolves them itself (`plan`, `train`: they print
    them)."""
    config = load_config(args.config, args.overrides)
    if derive_bucket_size:
        from app.profiling.budget import resolve_bucket_size

        config, _ = resolve_bucket_size(config)
    return config


def format_summary(summary: dict[str, Any], title: str = "data synth") -> str:
    """A two-column rich table of the summary, rendered to text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary.items():
        table.add_row(name, str(value))
    console = Console(width=100)
    with console.capture() as capture:
        console.print(table)
    return capture.get().rstrip()
