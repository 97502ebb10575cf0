"""`python -m app <command>` (also installed as `skrull`).

Each command lives in its own module under app/commands/ and is imported only when chosen, so that
`skrull plan` never imports torch, Ray or DeepSpeed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from app.config import ConfigError

# command name -> (module under app.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan", "dry run: plan sampled global batches with every policy and compare modeled step times"),
    "bench": ("bench", "benchmarks: `bench planner` (planning latency), `bench attention` (DACP overlap)"),
    "verify": ("verify", "parity check: one sharded DACP forward+backward vs the unsharded model"),
    "train": ("train", "train on Ray (embedded local Ray by default, or the cluster at RAY_ADDRESS)"),
    "data": ("data", "data tools: `data synth` writes a synthetic chat dataset"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skrull", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(f"app.commands.{module_name}")
        module.add_arguments(command_parser)
        command_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except ConfigError as err:
        print(f"skrull {args.command}: configuration error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
