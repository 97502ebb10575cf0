"""`python -m app train --config X [--set k=v] [--json] [--verbose]`: train on Ray.

Exit codes: 0 trained; 2 bad input (ConfigError: the knob named) or the run is held by another call; 130
after Ctrl-C and 143 after SIGTERM (both print the command that resumes the run); 1 any other failure.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys

from app.commands.common import add_config_arguments, add_json_argument, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, required=True)
    add_json_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--verbose", action="store_true",
                        help="show Ray's, DeepSpeed's and the workers' own output on the terminal "
                             "(by default it goes to <run_dir>/logs/driver.log)")


def resume_command(args: argparse.Namespace, name: str) -> str:
    """The command line that resumes run `name`: this one, with run.name pinned (it may be generated)."""
    words = ["python", "-m", "app", "train", "--config", args.config]
    kept = [override for override in args.overrides if not override.startswith("run.name=")]
    words += [part for override in [*kept, f"run.name={name}"] for part in ("--set", override)]
    words += [flag for flag, on in (("--json", args.json), ("--no-progress", args.no_progress),
                                    ("--verbose", args.verbose)) if on]
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    from app.train.driver import train
    from app.train.signals import RunInterrupted
    from workers.storage import redact_text

    config = config_from_args(args, derive_bucket_size=False)  # the driver derives it and says so
    # With --json, stdout carries only the summary line; worker errors still surface as exceptions.
    try:
        summary = train(config, progress=not args.no_progress and not args.json, quiet=not args.verbose)
    except RunInterrupted as stop:  # Ctrl-C or SIGTERM: exit 128 + the signal, as a shell reports it
        by = signal.Signals(stop.signal_number).name
        command = redact_text(resume_command(args, stop.name))  # no URI secret on the terminal
        print(f"\ninterrupted ({by}): Ray is shut down; {stop.run_dir} keeps its newest complete checkpoint. "
              f"Resume with:\n  {command}", file=sys.stderr, flush=True)
        return 128 + stop.signal_number
    if args.json:
        print(json.dumps(summary.to_json_dict()))
    else:
        print(f"trained {summary.steps} steps, {summary.samples} samples, {summary.tokens} tokens: loss "
              f"{summary.loss_first:.4f} -> {summary.loss_last:.4f}, {summary.tokens_per_s:.0f} tokens/s")
        print(f"run directory: {summary.run_dir} (log: logs/driver.log)\ncheckpoint: {summary.checkpoint}")
    return 0
