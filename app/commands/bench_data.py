"""`python -m app bench data --config X [--rows N] [--rounds 3] [--cpus N] [--json]`: tokenize throughput.

This project's Ray Data tokenize pipeline at 1 task and at every CPU, and Hugging Face `datasets.map(
num_proc=<same CPUs>)` running the same tokenize function on the same rows, alternately on one machine
(app/bench/data.py). Prints rows/s and tokens/s of each and the ratios; --json prints {"rows", "tokens",
"cpus", "rounds", "seconds", "rows_per_s", "tokens_per_s", "speedup_vs_one_task",
"speedup_vs_datasets_map", "load_average"}. Only the standard library is imported until it runs.
"""

from __future__ import annotations

import argparse
import json
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from app.commands.common import add_config_arguments, add_json_argument

    add_config_arguments(parser, required=True)
    add_json_argument(parser)
    parser.add_argument("--rows", type=int, default=None,
                        help="the first N rows of data.path, or of each data.sources entry (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per variant after a warm-up")
    parser.add_argument("--cpus", type=int, default=None,
                        help="tasks and num_proc of the parallel variants (default: this machine's CPUs)")


def run(args: argparse.Namespace) -> int:
    from app.bench.data import format_report, run_bench
    from app.commands.common import config_from_args
    from app.config import ConfigError
    from workers.storage import redact_uri

    if args.rows is not None and args.rows < 1:
        raise ConfigError(f"--rows={args.rows}: at least one row")
    if args.rounds < 1:
        raise ConfigError(f"--rounds={args.rounds}: at least one round")
    cpus = args.cpus or os.cpu_count() or 1
    config = config_from_args(args)
    summary = run_bench(config, rows=args.rows, rounds=args.rounds, cpus=cpus)
    sources = config.data.sources
    what = (f"data.sources ({', '.join(entry.source_id for entry in sources)})" if sources
            else f"data.path={redact_uri(config.data.path)!r}")
    where = f"{what}, tokenizer {config.data.tokenizer}"
    print(json.dumps(summary) if args.json else format_report(summary, where))
    return 0
