"""One pass over a tokenized stream's small columns: the run's data summary and the checks before training.

    batches of {status, reason, format, num_tokens, raw_tokens, label_tokens}, in stream order
        -> ScanTally.add (per batch: statuses, malformed reasons, formats, the three length columns)
        -> ScanTally.scan: DataScan (row count, usable lengths and positions, counts by status and format)
           + check_scan (malformed fraction, too long, no usable row: one DataError naming the knob)

`train` folds the materialized tokenized dataset's batches (scan_dataset), `data prepare` the blocks it
writes (app/data/prepare.py): both stop on the same errors. Memory: a few int64 columns and one status per
row (~40 bytes a row), never the token ids.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.config import DataConfig
from app.data import DataError
from app.data.formats import count_formats, describe_formats
from app.data.malformed import MalformedTally, check_malformed, data_location
from scheduling.payload import ROW_STATUSES, USABLE_STATUSES, RowStatus

SCAN_COLUMNS = ("status", "reason", "format", "num_tokens", "raw_tokens", "label_tokens")
"""What the scan reads of a tokenized row (app/data/ray_ops.py writes them)."""
_LENGTHS = ("num_tokens", "raw_tokens", "label_tokens")


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


class ScanTally:
    """Folds batches of the scan columns, in stream order, into a DataScan (see the module docstring)."""

    def __init__(self) -> None:
        self._statuses: list[np.ndarray] = []
        self._lengths: dict[str, list[np.ndarray]] = {name: [] for name in _LENGTHS}
        self._malformed = MalformedTally()
        self._formats: Counter[str] = Counter()

    def add(self, batch: Mapping[str, Any]) -> None:
        """The next rows: a mapping of SCAN_COLUMNS to array-likes (a numpy batch, or columns as numpy)."""
        status = np.asarray(batch["status"]).astype(str)
        self._statuses.append(status)
        self._malformed.add(status, np.asarray(batch["reason"]).astype(str))
        count_formats(self._formats, np.asarray(batch["format"]).astype(str))
        for name in _LENGTHS:
            self._lengths[name].append(np.asarray(batch[name], dtype=np.int64))

    def scan(self, data: DataConfig, *, max_length: int) -> DataScan:
        """The DataScan of every row added; DataError when it cannot train (check_scan)."""
        status = np.concatenate(self._statuses) if self._statuses else np.zeros(0, dtype=str)
        empty = np.zeros(0, dtype=np.int64)
        num_tokens, raw_tokens, label_tokens = (np.concatenate(parts) if parts else empty
                                                for parts in self._lengths.values())
        counts = {name: int(np.count_nonzero(status == name)) for name in ROW_STATUSES}
        usable = np.isin(status, USABLE_STATUSES)
        scan = DataScan(num_rows=len(status), lengths=num_tokens[usable], counts=counts,
                        label_tokens=int(label_tokens[usable].sum()), positions=np.flatnonzero(usable),
                        malformed=self._malformed, formats=dict(self._formats.most_common()))
        check_scan(data, scan, raw_tokens[status == RowStatus.TOO_LONG], max_length=max_length)
        return scan


def scan_dataset(dataset: Any, data: DataConfig, *, max_length: int) -> DataScan:
    """One pass over a tokenized Ray dataset's scan columns; DataError if it cannot train.

    `dataset` is `tokenized_dataset(...)` (the driver materializes a tokenizing one first, so the planner
    streams the same blocks and nothing is tokenized twice; a prepared one is read here for its small
    columns only). Errors: more malformed rows than data.max_malformed_fraction, any row longer than
    max_length with data.too_long=error, or no usable row at all (each names data.path).
    """
    tally = ScanTally()
    for batch in dataset.select_columns(list(SCAN_COLUMNS)).iter_batches(batch_size=4096,
                                                                         batch_format="numpy"):
        tally.add(batch)
    return tally.scan(data, max_length=max_length)


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
