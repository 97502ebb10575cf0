"""What a run directory holds for `report` and the metric sinks: every read and write of those files.

Written by the driver while the run goes (the progress thread, app/train/progress.py), read by `report`, which
needs nothing but the run directory:

    <run_dir>/metrics.jsonl        one line per reported step record, as ray.train.report carried it
                                   (world rank 0's; a restarted group's re-trained steps appear again:
                                   the last line of a step counts), appended across resumes
    <run_dir>/worker_starts.jsonl  one line per start of the worker group: {"driver", "session",
                                   "resumed_from_step", "total_steps", "time"}; "driver" names one `train`
                                   call, so restarts = starts - 1 within each call
    <run_dir>/data_summary.json    the data scan of the newest `train` call (rows, tokens, statuses)
    <run_dir>/mlflow_run.json      {"tracking_uri", "run_id"}: the MLflow run a resumed run continues
    <run_dir>/wandb_run.json       {"project", "entity", "run_id"}: the W&B run a resumed run continues
    <run_dir>/skrull_config.json, skrull_data.json, chat_template.jinja
                                   what the run started with (app/rundir/snapshot.py)

Consistency while a run is being written: each JSONL record is one write() of one whole line on a file
opened for appending, and readers take complete lines only (a torn last line, from a writer caught
mid-write, is left for the next read; a write that fails, e.g. on a full disk, is cut back off); JSON
documents are replaced whole (write to a temporary file, then os.replace). Non-finite floats are written as
null (strict JSON).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
STARTS_FILE = "worker_starts.jsonl"
DATA_SUMMARY_FILE = "data_summary.json"
MLFLOW_RUN_FILE = "mlflow_run.json"
WANDB_RUN_FILE = "wandb_run.json"
CONFIG_SNAPSHOT = "skrull_config.json"
"""The config a run started with, URIs redacted (app/rundir/snapshot.py writes and compares it)."""
DATA_SNAPSHOT = "skrull_data.json"
"""The data the run started with: {"data.path": fingerprint, "data.eval_path": fingerprint or absent}
(app/data/fingerprint.py), compared like the math keys; a run without one resumes unchecked."""
TEMPLATE_SNAPSHOT = "chat_template.jinja"
"""The chat template the run rendered its chats with (absent: data.chat_template=none)."""


def jsonable(value: Any) -> Any:
    """`value` with every NaN / infinity (a spare rank's compute time, a missing grad norm) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record as one line with a single write (readers never see half of it as whole); a write
    that fails (a full disk) is cut back off, so no torn line stays in the middle of the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(jsonable(record), allow_nan=False) + "\n"
    size = path.stat().st_size if path.exists() else 0
    try:
        with path.open("a", encoding="utf-8") as out:
            out.write(line)
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line's record ([] when the file does not exist yet); a torn last line is skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # the part after the last newline is an unfinished write
    return [json.loads(line) for line in lines if line.strip()]


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Replace `path` with `document` whole (a reader sees the old or the new file, never a mix)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(jsonable(document), out, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    """The document at `path`, or None when there is none."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def data_summary(scan: Any, *, train_rows: int, eval_rows: int = 0) -> dict[str, Any]:
    """The data scan (app/data/scan.py DataScan) as data_summary.json's document."""
    lengths = [int(n) for n in scan.lengths]
    return {"line": scan.summary(), "rows": int(scan.num_rows), "usable_rows": int(scan.num_usable),
            "tokens": sum(lengths), "label_tokens": int(scan.label_tokens),
            "length_median": float(statistics.median(lengths)) if lengths else 0.0,
            "length_max": max(lengths, default=0),
            "statuses": {status: int(n) for status, n in scan.counts.items() if n},
            "formats": {name: int(n) for name, n in getattr(scan, "formats", {}).items()},
            "train_rows": int(train_rows), "eval_rows": int(eval_rows)} | (
        {"sources": scan.sources} if getattr(scan, "sources", None) else {})


def write_data_summary(run_dir: str | Path, summary: dict[str, Any]) -> None:
    write_json(Path(run_dir) / DATA_SUMMARY_FILE, summary)


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """Everything `report` reads: {"config", "records", "starts", "data"} (missing parts empty / None)."""
    root = Path(run_dir)
    return {"config": read_json(root / CONFIG_SNAPSHOT), "records": read_jsonl(root / METRICS_FILE),
            "starts": read_jsonl(root / STARTS_FILE), "data": read_json(root / DATA_SUMMARY_FILE)}


def is_run_dir(run_dir: str | Path) -> bool:
    """A directory `train` made: it holds the config snapshot."""
    return (Path(run_dir) / CONFIG_SNAPSHOT).is_file()
