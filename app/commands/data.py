"""`skrull data synth` writes a synthetic chat dataset; `skrull data preview` shows rows as training does;
`skrull data prepare` tokenizes a run's data once (app/commands/data_prepare.py).

    python -m app data preview --config X [-n 3] [--set KEY=VALUE ...] [--json]
    python -m app data prepare --config X --out DIR|URI [--set KEY=VALUE ...] [--overwrite] [--json]

`preview` prints the first n rows after the row format, the chat template and the length limit (app/data/
preview.py): each row's status, format, tokens and label tokens, and its decoded text with the
loss-bearing tokens highlighted; --json prints {"sources": {ID: {"rows", "tokens", "share"}}, "rows":
[{"index", "status", "format", "reason", "source", "num_tokens", "label_tokens", "input_ids", "labels"}]}
(labels: -100 where there is no loss; "sources": the rows by source over these rows, data.sources' mix).

`synth`:

    python -m app data synth --dist lmsys --n 10000 --out data/lmsys [--seed 0] [--length-scale 1.0]
                             [--tokenizer qwen|PATH] [--rows-per-file 50000] [--overwrite] [--json]

Rows: `sample_id` (int64) and `messages` (list of {role, content}). Target lengths are
`scheduling.sample_lengths(dist, n, seed) * length_scale` in tokens after the tokenizer and the Qwen chat
template; the command re-tokenizes the first rows it wrote and prints the measured error.

Writes cannot lose data: every file goes into a temporary directory next to --out (same filesystem), and
only when all of them are written do they replace --out's part-*.parquet files (app/commands/staging.py). A
failure at any point (a bad --tokenizer, a full disk, an unwritable --out) leaves --out exactly as it was.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from app.commands import data_prepare
from app.commands.common import add_config_arguments, add_json_argument, config_from_args, format_summary
from app.commands.staging import staged_output
from app.config import ConfigError

_VERIFY_ROWS = 2000  # rows re-tokenized after writing to measure |actual - target| (~0.5 s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    synth = sub.add_parser("synth", help="write a synthetic chat dataset as parquet")
    synth.add_argument("--dist", required=True, choices=("lmsys", "wikipedia", "chatqa2"),
                       help="length distribution (scheduling.sample_lengths)")
    synth.add_argument("--n", type=int, required=True, help="number of conversations")
    synth.add_argument("--out", required=True, help="output directory (part-*.parquet files)")
    synth.add_argument("--seed", type=int, default=0, help="seed of lengths and conversation shapes")
    synth.add_argument("--length-scale", type=float, default=1.0, help="multiply target lengths by this")
    synth.add_argument("--tokenizer", default="qwen", help="qwen, a HF tokenizer dir, or a tokenizer.json")
    synth.add_argument("--rows-per-file", type=int, default=50_000, help="rows per parquet file")
    synth.add_argument("--overwrite", action="store_true", help="replace part-*.parquet in --out")
    add_json_argument(synth)
    preview = sub.add_parser("preview", help="the first rows after the template and the length limit, "
                             "decoded, loss-bearing tokens highlighted")
    add_config_arguments(preview)
    preview.add_argument("-n", type=int, default=3, help="how many rows (default 3)")
    add_json_argument(preview)
    prepare = sub.add_parser("prepare", help="tokenize the run's data once on Ray into Parquet shards and a "
                             "manifest; train from them with data.source=prepared")
    data_prepare.add_arguments(prepare)  # stdlib-only at import: Ray loads when it runs


def run(args: argparse.Namespace) -> int:
    if args.data_command == "preview":
        return show_preview(args)
    if args.data_command == "prepare":
        return data_prepare.run(args)
    if args.data_command == "synth":
        summary = synthesize(args)
        print(json.dumps(summary) if args.json else format_summary(summary))
        return 0
    raise ConfigError(f"unknown data subcommand {args.data_command!r}")


def _check_args(args: argparse.Namespace) -> Path:
    """Validate the arguments and --out without touching the disk."""
    if args.n < 1:
        raise ConfigError(f"--n={args.n}: need at least one conversation")
    if args.length_scale <= 0:
        raise ConfigError(f"--length-scale={args.length_scale}: must be > 0")
    if args.rows_per_file < 1:
        raise ConfigError(f"--rows-per-file={args.rows_per_file}: must be >= 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out={args.out!r} is a file, not a directory; choose another --out")
    existing = sorted(out.glob("*.parquet")) if out.is_dir() else []
    if existing and not args.overwrite:
        raise ConfigError(f"--out={args.out!r} already holds {len(existing)} parquet files; pass --overwrite")
    foreign = [p.name for p in existing if not p.name.startswith("part-")]
    if foreign:
        raise ConfigError(f"--out={args.out!r} holds parquet files `data synth` did not write: {foreign[:3]}")
    return out


def synthesize(args: argparse.Namespace) -> dict[str, Any]:
    """Generate and write the dataset in files of --rows-per-file rows; return the summary dict."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.ray_ops import MESSAGES_TYPE
    from app.data.synth import ConversationSynth, synth_conversations, target_lengths
    from app.data.tokenizer import load_tokenizer

    out = _check_args(args)
    start = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)  # before anything is written: a bad --tokenizer changes nothing
    synth = ConversationSynth(tok)
    scaled = target_lengths(args.dist, args.n, args.seed, args.length_scale)
    targets = np.maximum(scaled, synth.min_length())  # the generator raises shorter targets to its minimum
    files: list[str] = []
    verify: list[list[dict[str, str]]] = []
    with staged_output(out) as staging:
        for first in range(0, args.n, args.rows_per_file):
            ids = np.arange(first, min(first + args.rows_per_file, args.n), dtype=np.int64)
            conversations = synth_conversations(synth, ids, targets[ids], args.dist, args.seed)
            verify += conversations[: max(0, _VERIFY_ROWS - len(verify))]
            name = f"part-{len(files):05d}.parquet"
            table = pa.table({"sample_id": pa.array(ids), "messages": pa.array(conversations, MESSAGES_TYPE)})
            pq.write_table(table, staging / name)
            files.append(str(out / name))
        measured = _measured_lengths(tok, verify)
    seconds = time.perf_counter() - start
    summary = _summary(args, targets, files, seconds, measured)
    summary["raised_to_min"] = int(np.count_nonzero(scaled < targets))
    return summary


def _measured_lengths(tok: Any, conversations: list[list[dict[str, str]]]) -> Any:
    """Token counts of conversations through the real template path (what training will see)."""
    from app.data.template import TemplateSettings, tokenize_rows

    out = tokenize_rows([{"messages": c} for c in conversations], tok, TemplateSettings(labels="all"))
    return out.raw_tokens


def _summary(args: argparse.Namespace, targets: Any, files: list[str], seconds: float,
             measured: list[int]) -> dict[str, Any]:
    import numpy as np

    error = np.abs(np.asarray(measured) - targets[: len(measured)])
    p50, p90, p99 = (int(v) for v in np.percentile(targets, [50, 90, 99]))
    return {
        "out": args.out, "files": len(files), "rows": int(len(targets)), "tokens": int(targets.sum()),
        "distribution": args.dist, "seed": args.seed, "length_scale": args.length_scale,
        "tokenizer": args.tokenizer, "seconds": round(seconds, 2),
        "length_min": int(targets.min()), "length_p50": p50, "length_p90": p90, "length_p99": p99,
        "length_max": int(targets.max()), "length_mean": round(float(targets.mean()), 1),
        "verified_rows": int(len(measured)), "abs_error_median": float(np.median(error)),
        "abs_error_max": int(error.max()),
    }


def show_preview(args: argparse.Namespace) -> int:
    """`data preview`: rich text on a terminal, one JSON object with --json."""
    from app.data.preview import labeled_spans, preview_rows, row_header, source_shares
    from app.data.scan import describe_sources

    if args.n < 1:
        raise ConfigError(f"-n must be >= 1, got {args.n}")
    config = config_from_args(args)
    rows, tok = preview_rows(config, args.n)
    shares = source_shares(rows)
    if args.json:
        print(json.dumps({"sources": shares, "rows": [row.as_json() for row in rows]}))
        return 0
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False)
    kind = f"{len(config.data.sources)} sources" if config.data.sources else f"{config.data.source} data"
    console.print(f"data preview: {len(rows)} rows of {kind}, tokenizer "
                  f"{config.data.tokenizer}, template {config.data.chat_template}; [bold green]green[/] "
                  "tokens carry the loss")
    if config.data.sources:
        console.print(f"the mix over these rows: {describe_sources(shares)}")
    for row in rows:
        console.rule(row_header(row), align="left")
        text = Text()
        for part, labeled in labeled_spans(tok, row):
            text.append(part, style="bold green" if labeled else "dim")
        console.print(text)
    return 0
