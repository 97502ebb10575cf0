"""The Ray Data pipeline of a run: read (or synthesize) -> tokenize, in a deterministic row order.

    data.source=path        read_parquet(files) | read_text(jsonl files) | from_arrow(load_from_disk)
    data.source=hf          from_arrow(load_dataset(data.path, data.name, data.split, data.data_files))
                            -> map_batches(tokenize)
    data.source=synthetic   range(data.num_samples) -> map_batches(synthesize_and_tokenize)
    both                    -> rows {input_ids, labels, num_tokens, raw_tokens, label_tokens, status, reason,
                                     format}

Each map is one task at a time (`TaskPoolStrategy(size=1)`, resources.data_cpus each), which Ray Data fuses
with the read into one task (app/data/ray_ops.py says why not an actor).

The planner numbers samples by their position in this stream and resumes by skipping a count, so the
pipeline sets `DataContext.preserve_order = True` and reads files in sorted order. Everything that can be
wrong with the input (missing path, unknown format, a tokenizer that does not load) was checked on the
driver, before any Ray task starts, by resolve_data (app/data/resolved.py), whose result the pipeline
takes. Nothing here calls `ray.init`: the caller owns the cluster.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.config import DataConfig
from app.data import DataError
from app.data.formats import count_formats, describe_formats
from app.data.malformed import MalformedTally, check_malformed, data_location
from app.data.ray_ops import synthesize_and_tokenize, tokenize
from app.data.readers import DataSource, arrow_table
from app.data.resolved import ResolvedData
from app.data.template import TemplateSettings
from scheduling.payload import ROW_STATUSES, USABLE_STATUSES, RowStatus


@dataclass(frozen=True, eq=False)
class DataScan:
    """One pass over the tokenized stream: row count, usable lengths (stream order), per-status counts.

    label_tokens: label tokens (after truncation and the shift) summed over the usable rows, i.e. the
    number of next-token targets one epoch trains on. counts["truncated"] rows were cut and still train,
    counts["truncated_empty"] rows were cut to a window without a label token and are skipped; together
    they are the rows data.too_long=truncate changed. `malformed` counts the malformed rows by reason
    and keeps the first one's stream position (app/data/malformed.py). `formats` counts the rows by the
    row format that read them (data.format_type=auto decides per row; app/data/formats/).
    """

    num_rows: int
    lengths: np.ndarray
    counts: dict[str, int] = field(default_factory=dict)
    label_tokens: int = 0
    positions: np.ndarray | None = None
    """Stream positions (= sample ids) of the usable rows, aligned with `lengths`; the eval split
    (app/data/split.py) counts the held-out ones. None: not recorded."""
    malformed: MalformedTally = field(default_factory=MalformedTally)
    formats: dict[str, int] = field(default_factory=dict)
    """Rows by row format ({"sharegpt": 318}); rows that no format read (malformed) are not counted."""

    @property
    def num_usable(self) -> int:
        return int(sum(self.counts.get(status, 0) for status in USABLE_STATUSES))

    def summary(self) -> str:
        """One line for logs: usable rows, their tokens and label tokens, every non-zero status count, then
        the rows by format unless they are all `messages` rows (app/data/formats describe_formats).

            data: 318/320 rows usable, 54124 tokens (12000 label tokens), truncated=5, truncated_empty=2
            data: 40/80 rows usable, 2960 tokens (840 label tokens), malformed=40 (40 'messages[1].content
                  is a number, not a string'; first: row 1)
            data: 318/320 rows usable, 54124 tokens (12000 label tokens), malformed=2 (2 'no messages,
                  conversations, instruction/output, prompt/completion or text column'; first: row 7);
                  formats: sharegpt=310, alpaca=8
        """
        parts = [f"{self.num_usable}/{self.num_rows} rows usable",
                 f"{int(self.lengths.sum())} tokens ({self.label_tokens} label tokens)"]
        parts += [self._status_part(status, n) for status, n in self.counts.items()
                  if n and status != RowStatus.OK]
        formats = describe_formats(self.formats)
        return "data: " + ", ".join(parts) + (f"; {formats}" if formats else "")

    def _status_part(self, status: str, n: int) -> str:
        """`status=n`, for malformed rows followed by their reasons and the first one."""
        breakdown = self.malformed.breakdown() if status == RowStatus.MALFORMED else ""
        return f"{status}={n} ({breakdown})" if breakdown else f"{status}={n}"


def tokenized_dataset(data: ResolvedData, *, num_cpus: float) -> Any:
    """The run's tokenized rows as a lazy `ray.data.Dataset` (columns: see module docstring).

    `data` is what preflight resolved (app/data/resolved.py): its sources, template settings (with the
    run's longest sequence) and tokenizer were checked there, so nothing here can fail on bad input
    before Ray runs. num_cpus: what each Ray Data task reserves (resources.data_cpus).
    """
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    if data.source is None:
        return _synthetic_dataset(data.config, data.settings, num_cpus)
    source, json_lines = _source_dataset(data.source)
    return source.map_batches(
        tokenize, fn_kwargs={"tokenize": (data.config.tokenizer, data.settings, json_lines)},
        batch_size=data.config.tokenize_batch_size, batch_format="pyarrow",
        compute=ray.data.TaskPoolStrategy(size=1), num_cpus=num_cpus,
    )


def _synthetic_dataset(data: DataConfig, settings: TemplateSettings, num_cpus: float) -> Any:
    """range(data.num_samples) -> synthesized and tokenized rows."""
    import ray.data

    if data.num_samples < 1:
        raise DataError(f"data.num_samples={data.num_samples}: the synthetic source needs >= 1 sample")
    # One block per ~4k ids: Ray Data would otherwise start one 1-CPU read task per few rows.
    blocks = max(1, data.num_samples // 4096)
    synthesize = (data.tokenizer, data.distribution, data.num_samples, data.seed, data.length_scale)
    return ray.data.range(data.num_samples, override_num_blocks=blocks).map_batches(
        synthesize_and_tokenize, fn_kwargs={"synthesize": synthesize, "tokenize": (data.tokenizer, settings)},
        batch_size=data.tokenize_batch_size, batch_format="pyarrow",
        compute=ray.data.TaskPoolStrategy(size=1), num_cpus=num_cpus,
    )


def _source_dataset(source: DataSource) -> tuple[Any, bool]:
    """(rows dataset of a resolved data.path, every column; whether its `text` column holds raw JSONL
    lines).

    A `datasets` source (save_to_disk or load_dataset) goes in as the Arrow table resolve_source already
    loaded, which is what `ray.data.from_huggingface` does with a local Dataset, minus its first step: that
    one reloads the dataset by name and asks huggingface.co for a parquet export to read over HTTP instead
    (a second load, then HTTP requests that HF_HUB_OFFLINE does not stop, from the driver and Ray tasks).
    """
    import ray.data

    if source.format == "parquet":
        return read_parquet(source.files, source.filesystem), False
    if source.format == "jsonl":
        lines = ray.data.read_text(list(source.files), drop_empty_lines=True, filesystem=source.filesystem)
        return lines, True
    return ray.data.from_arrow(arrow_table(source)), False


FOOTER_ACTORS_KNOB = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
"""Ray Data's size of the actor pool that reads parquet footers when a read is listed (32 by default)."""
FILES_PER_FOOTER_BATCH = 10
"""Files per footer-reading call (Ray Data's RAY_DATA_PARQUET_FOOTER_BATCH_SIZE default)."""
MAX_FOOTER_ACTORS = 32


def footer_actors(num_files: int) -> int:
    """Footer readers that `num_files` can keep busy: one per batch of files, at most Ray Data's default."""
    return max(1, min(MAX_FOOTER_ACTORS, math.ceil(num_files / FILES_PER_FOOTER_BATCH)))


def read_parquet(files: tuple[str, ...], filesystem: Any) -> Any:
    """ray.data.read_parquet(files), with a footer-reader pool sized to the files.

    Ray Data's parquet reader lists its input by reading every footer on a pool of
    RAY_DATA_PARQUET_FOOTER_NUM_ACTORS actors (32 by default), each a Python process of its own (~2-3 s
    of CPU to start on a 2-core machine), fed batches of 10 files: a pool larger than the number of
    batches only costs start-ups (a one-file dataset started 4 of them on 2 cores, ~8 s of CPU per
    run, measured 2026-11-26). The read gets footer_actors(len(files)) unless the environment sets the
    knob; Ray Data reads it when the read is built (here, on the driver) and ships it with the plan.
    """
    import ray.data

    if FOOTER_ACTORS_KNOB in os.environ:
        return ray.data.read_parquet(list(files), filesystem=filesystem)
    os.environ[FOOTER_ACTORS_KNOB] = str(footer_actors(len(files)))
    try:
        return ray.data.read_parquet(list(files), filesystem=filesystem)
    finally:
        del os.environ[FOOTER_ACTORS_KNOB]


def scan_dataset(dataset: Any, data: DataConfig, *, max_length: int) -> DataScan:
    """One pass over a tokenized dataset's length and status columns; DataError if it cannot train.

    `dataset` is `tokenized_dataset(...)` (the driver materializes it first, so the planner streams the
    same blocks and nothing is tokenized twice). Errors: more malformed rows than
    data.max_malformed_fraction, any row longer than max_length with data.too_long=error, or no usable row
    at all (each names data.path).
    """
    names = ("num_tokens", "raw_tokens", "label_tokens")
    statuses: list[np.ndarray] = []
    columns: dict[str, list[np.ndarray]] = {name: [] for name in names}
    malformed = MalformedTally()
    formats: Counter[str] = Counter()
    selected = dataset.select_columns(["status", "reason", "format", *names])
    for batch in selected.iter_batches(batch_size=4096, batch_format="numpy"):
        statuses.append(np.asarray(batch["status"]).astype(str))
        malformed.add(statuses[-1], np.asarray(batch["reason"]).astype(str))
        count_formats(formats, np.asarray(batch["format"]).astype(str))
        for name in names:
            columns[name].append(np.asarray(batch[name], dtype=np.int64))
    status = np.concatenate(statuses) if statuses else np.zeros(0, dtype=str)
    num_tokens, raw_tokens, label_tokens = (
        np.concatenate(columns[name]) if statuses else np.zeros(0, dtype=np.int64) for name in names)
    counts = {name: int(np.count_nonzero(status == name)) for name in ROW_STATUSES}
    usable = np.isin(status, USABLE_STATUSES)
    scan = DataScan(num_rows=len(status), lengths=num_tokens[usable], counts=counts,
                    label_tokens=int(label_tokens[usable].sum()), positions=np.flatnonzero(usable),
                    malformed=malformed, formats=dict(formats.most_common()))
    check_scan(data, scan, raw_tokens[status == RowStatus.TOO_LONG], max_length=max_length)
    return scan


def check_scan(data: DataConfig, scan: DataScan, too_long_lengths: np.ndarray, *, max_length: int) -> None:
    """Turn a scan that cannot train into one DataError naming the knob to change.

    Malformed rows come first: a file that cannot be read says so, not "no usable rows".
    """
    check_malformed(data, scan.malformed)
    if len(too_long_lengths):
        raise DataError(
            f"{len(too_long_lengths)} of {scan.num_rows} rows are longer than the maximum sequence length "
            f"{max_length} tokens (longest: {int(too_long_lengths.max())}); the limit is data.max_length "
            f"(={data.max_length}, 0 = no extra cap) capped by scheduling.bucket_size * parallel.cp_size. "
            "Set data.too_long=truncate or data.too_long=drop, or raise scheduling.bucket_size / "
            "parallel.cp_size"
        )
    if scan.num_usable == 0:
        where = data_location(data)
        bad = ", ".join(f"{k}={v}" for k, v in scan.counts.items() if v)
        hints: list[str] = []
        if scan.counts.get(RowStatus.EMPTY):
            hints.append(f"empty rows have no label token (data.labels={data.labels}; with assistant a chat "
                         "needs an assistant turn, and a row of one token has no next token to learn)")
        if scan.counts.get(RowStatus.TRUNCATED_EMPTY):
            hints.append(f"truncation to {max_length} tokens cut every label token away (data.too_long="
                         f"truncate, data.truncate_side={data.truncate_side}; left keeps the end of a chat): "
                         "raise data.max_length or scheduling.bucket_size * parallel.cp_size")
        if scan.malformed.count:
            hints.append(f"{scan.malformed.detail()} (data.max_malformed_fraction="
                         f"{data.max_malformed_fraction})")
        raise DataError(f"no usable rows in {where} ({scan.num_rows} rows: {bad or 'none'})"
                        + "".join(f"; {hint}" for hint in hints))
