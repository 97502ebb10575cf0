"""`skrull data synth` writes a synthetic chat dataset; `skrull data preview` shows rows as training does.

    python -m app data preview --config X [-n 3] [--set KEY=VALUE ...] [--json]

`preview` prints the first n rows after the row format, the chat template and the length limit (app/data/
preview.py): each row's status, format, tokens and label tokens, and its decoded text with the
loss-bearing tokens highlighted; --json prints {"rows": [{"index", "status", "format", "num_tokens",
"label_tokens", "input_ids", "labels"}]} (labels: -100 where there is no loss).

`synth`:

    python -m app data synth --dist lmsys --n 10000 --out data/lmsys [--seed 0] [--length-scale 1.0]
                             [--tokenizer qwen|PATH] [--rows-per-file 50000] [--overwrite] [--json]

Rows: `sample_id` (int64) and `messages` (list of {role, content}). Target lengths are
`scheduling.sample_lengths(dist, n, seed) * length_scale` in tokens after the tokenizer and the Qwen chat
template; the command re-tokenizes the first rows it wrote and prints the measured error.

Writes cannot lose data: every file goes into a temporary directory next to --out (same filesystem), and
only when all of them are written do they replace --out's part-*.parquet files (see `staged_output`). A
failure at any point (a bad --tokenizer, a full disk, an unwritable --out) leaves --out exactly as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from app.commands.common import add_config_arguments, add_json_argument, config_from_args
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


def run(args: argparse.Namespace) -> int:
    if args.data_command == "preview":
        return show_preview(args)
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


def _unwritable(out: Path, err: OSError) -> ConfigError:
    return ConfigError(f"--out={str(out)!r} cannot be written ({type(err).__name__}: {err}); nothing in it "
                       "was changed; choose a writable --out")


@contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """Yield an empty staging directory; on a clean exit its files replace out's *.parquet files.

        1. create out's missing parents; staging = a fresh temporary directory next to out (same parent,
           so the same filesystem and every rename below is atomic); inside out when out is a mount point
           or its parent cannot be written
        2. the caller writes every file into staging
        3. commit, when out is missing: rename(staging, out)
                   when out is a plain dir holding only *.parquet files: rename(out, aside),
                       rename(staging, out), delete aside (a reader sees the old files or the new
                       ones, never a mix; between the two renames, for an instant, no directory)
                   otherwise (other files in out, a symlink, a mount point): move out's *.parquet into a
                       temporary dir inside out, move the new files in, delete the old ones; each step is a
                       rename, and a failure moves everything back
    On any exception (in the caller's writing or in the commit) staging and the parents this created are
    removed, out is exactly as it was, and an OSError comes back as one ConfigError naming --out.
    """
    created = _make_parents(out)
    staging: Path | None = None
    try:
        staging = _make_staging(out)
        yield staging
        _commit(staging, out)
    except BaseException as err:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for directory in reversed(created):  # deepest first; rmdir only removes them while empty
            with suppress(OSError):
                directory.rmdir()
        if isinstance(err, OSError):
            raise _unwritable(out, err) from None
        raise


def _make_parents(out: Path) -> list[Path]:
    """mkdir out's missing parents; the ones created, outermost first (to remove them on failure)."""
    missing = [parent for parent in reversed(out.absolute().parents) if not parent.exists()]
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a parent is a file, or a read-only directory
        for directory in reversed(missing):
            with suppress(OSError):
                directory.rmdir()
        raise _unwritable(out, err) from None
    return missing


def _make_staging(out: Path) -> Path:
    """A fresh directory on out's filesystem, with the mode out has (or, when out is new, mkdir's)."""
    in_place = out.is_dir() and (os.path.ismount(out) or not os.access(out.absolute().parent, os.W_OK))
    where = out if in_place else out.absolute().parent
    while True:  # os.mkdir, not tempfile.mkdtemp (0700): after the rename this directory *is* out
        staging = where / f".{out.name}.synth-{secrets.token_hex(4)}"
        try:
            staging.mkdir()
            break
        except FileExistsError:
            continue
    if out.is_dir():
        staging.chmod(out.stat().st_mode & 0o7777)
    return staging


def _commit(staging: Path, out: Path) -> None:
    if not out.exists():
        os.rename(staging, out)
        return
    entries = list(out.iterdir())
    only_parquet = all(p.is_file() and p.suffix == ".parquet" for p in entries)
    if only_parquet and staging.parent == out.absolute().parent and not out.is_symlink() \
            and not os.path.ismount(out):
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=staging.parent))
        os.rename(out, aside)  # onto the empty directory mkdtemp made: POSIX rename replaces it
        try:
            os.rename(staging, out)
        except OSError:
            os.rename(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return
    _swap_files(staging, out)


def _swap_files(staging: Path, out: Path) -> None:
    """Replace out's *.parquet with staging's files one rename at a time, undoing every step on failure."""
    old_dir = Path(tempfile.mkdtemp(prefix=".synth-old-", dir=out))
    moved_old: list[Path] = []
    moved_new: list[Path] = []
    try:
        for old in sorted(out.glob("*.parquet")):
            os.rename(old, old_dir / old.name)
            moved_old.append(old)
        for new in sorted(staging.iterdir()):
            os.rename(new, out / new.name)
            moved_new.append(out / new.name)
    except OSError:
        for new in moved_new:
            with suppress(OSError):
                os.rename(new, staging / new.name)
        for old in moved_old:
            with suppress(OSError):
                os.rename(old_dir / old.name, old)
        shutil.rmtree(old_dir, ignore_errors=True)
        raise
    shutil.rmtree(old_dir, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


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


def format_summary(summary: dict[str, Any]) -> str:
    """A two-column rich table of the summary, rendered to text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="data synth")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary.items():
        table.add_row(name, str(value))
    console = Console(width=100)
    with console.capture() as capture:
        console.print(table)
    return capture.get().rstrip()


def show_preview(args: argparse.Namespace) -> int:
    """`data preview`: rich text on a terminal, one JSON object with --json."""
    from app.data.preview import labeled_spans, preview_rows, row_header

    if args.n < 1:
        raise ConfigError(f"-n must be >= 1, got {args.n}")
    config = config_from_args(args)
    rows, tok = preview_rows(config, args.n)
    if args.json:
        print(json.dumps({"rows": [row.as_json() for row in rows]}))
        return 0
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False)
    console.print(f"data preview: {len(rows)} rows of {config.data.source} data, tokenizer "
                  f"{config.data.tokenizer}, template {config.data.chat_template}; [bold green]green[/] "
                  "tokens carry the loss")
    for row in rows:
        console.rule(row_header(row), align="left")
        text = Text()
        for part, labeled in labeled_spans(tok, row):
            text.append(part, style="bold green" if labeled else "dim")
        console.print(text)
    return 0
