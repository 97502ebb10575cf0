"""`python -m app report RUN_DIR [--plot out.png] [--json]`: a finished or running run in one screen.

Needs nothing but the run directory (app/train/report.py reads what the driver persisted there); never
imports torch, Ray or DeepSpeed.
"""

from __future__ import annotations

import argparse
import json

from app.commands.common import add_json_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory: <run.storage_path>/<run.name>")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="also write loss and tokens/s over steps and per-rank busy time to this PNG")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from app.train.report import report_lines, run_report, write_plot

    report = run_report(args.run_dir)
    if args.plot:
        write_plot(report, args.plot)
    if args.json:
        print(json.dumps(report, allow_nan=False))
    else:
        print("\n".join(report_lines(report)))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
