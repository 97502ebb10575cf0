"""One pass over a tokenized stream's small columns: the run's data summary and the checks before training.

    batches of {status, reason, format, source, num_tokens, raw_tokens, label_tokens}, in table order
        -> ScanTally.add (per batch: statuses, malformed rows' reasons, format and source codes, the three
           length columns)
        -> ScanTally.scan: with data.sources first the mixed stream (scheduling/mix.py: which table row
           each stream position reads), then DataScan over the stream (row count, usable lengths and
           positions = sample ids, counts by status and format, rows / tokens / share by source)
           + check_sources (per source: its rows, a per-message field error, too many malformed rows, no
             usable row: a DataError naming data.sources[i] and the key)
           + check_scan (malformed fraction, too long, no usable row: one DataError naming the knob)

`train` folds the materialized tokenized dataset's batches (scan_dataset), `data prepare` the blocks it
writes (app/data/prepare.py): both stop on the same errors. Memory: a few int64 columns and one status per
row (~40 bytes a row), never the token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.config import DataConfig
from app.data import DataError
from app.data.formats import describe_formats
from app.data.formats.fields import FIELD_MARK
from app.data.malformed import MalformedTally, check_malformed, data_location
from app.data.sources import mix_spec
from scheduling.mix import stream_rows
from scheduling.payload import ROW_STATUSES, USABLE_STATUSES, RowStatus

SCAN_COLUMNS = ("status", "reason", "format", "source", "num_tokens", "raw_tokens", "label_tokens")
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
    sources: dict[str, dict[str, float]] = field(default_factory=dict)
    """With data.sources: {id: {"rows", "usable_rows", "tokens", "share"}} over the stream (tokens of its
    usable rows, share = rows / stream rows); {} for one source."""
    read: dict[str, int] = field(default_factory=dict)
    """Rows tokenized per source id (the table, before the mix): what a prepared set holds."""

    @property
    def num_usable(self) -> int:
        return int(sum(self.counts.get(status, 0) for status in USABLE_STATUSES))

    def source_rows(self) -> dict[str, int]:
        return dict(self.read)

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
        return ("data: " + ", ".join(parts) + (f"; {formats}" if formats else "")
                + (f"; {describe_sources(self.sources)}" if self.sources else ""))

    def _status_part(self, status: str, n: int) -> str:
        """`status=n`, for malformed rows followed by their reasons and the first one."""
        breakdown = self.malformed.breakdown() if status == RowStatus.MALFORMED else ""
        return f"{status}={n} ({breakdown})" if breakdown else f"{status}={n}"


def describe_sources(sources: dict[str, dict[str, float]]) -> str:
    """`sources: chat=1200 rows 60.0% (180000 tokens), tools=400 rows 20.0% (...)`."""
    return "sources: " + ", ".join(f"{name}={int(s['rows'])} rows {100 * s['share']:.1f}% "
                                   f"({int(s['tokens'])} tokens)" for name, s in sources.items())


class _Codes:
    """A string column of many batches as int16 codes into the values seen (first seen, first code)."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}
        self.parts: list[np.ndarray] = []

    def add(self, values: Any) -> None:
        unique, inverse = np.unique(np.asarray(values).astype(str), return_inverse=True)
        mapping = np.asarray([self.names.setdefault(str(name), len(self.names)) for name in unique], np.int16)
        self.parts.append(mapping[inverse.reshape(-1)] if len(unique) else np.zeros(0, np.int16))

    def codes(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0, np.int16)

    @property
    def values(self) -> list[str]:
        return list(self.names)


class ScanTally:
    """Folds batches of the scan columns, in table order, into a DataScan (see the module docstring)."""

    def __init__(self) -> None:
        self._statuses: list[np.ndarray] = []
        self._lengths: dict[str, list[np.ndarray]] = {name: [] for name in _LENGTHS}
        self._reasons: dict[int, str] = {}
        """Table row -> reason, of the malformed rows only."""
        self._formats = _Codes()
        self._sources = _Codes()
        self._rows = 0

    def add(self, batch: Mapping[str, Any]) -> None:
        """The next rows: a mapping of SCAN_COLUMNS to array-likes (a numpy batch, or columns as numpy);
        a batch without `source` is source ""."""
        status = np.asarray(batch["status"]).astype(str)
        self._statuses.append(status)
        bad = np.flatnonzero(status == RowStatus.MALFORMED)
        if len(bad):
            reasons = np.asarray(batch["reason"], dtype=object)
            self._reasons.update({self._rows + int(i): str(reasons[i]) or "unknown reason" for i in bad})
        self._formats.add(batch["format"])
        self._sources.add(batch["source"] if "source" in batch else np.full(len(status), ""))
        for name in _LENGTHS:
            self._lengths[name].append(np.asarray(batch[name], dtype=np.int64))
        self._rows += len(status)

    def scan(self, data: DataConfig, *, max_length: int) -> DataScan:
        """The DataScan of the stream of every row added; DataError when it cannot train (check_sources,
        check_scan)."""
        status = np.concatenate(self._statuses) if self._statuses else np.zeros(0, dtype=str)
        empty = np.zeros(0, dtype=np.int64)
        num_tokens, raw_tokens, label_tokens = (np.concatenate(parts) if parts else empty
                                                for parts in self._lengths.values())
        sources, names = self._sources.codes(), self._sources.values
        check_sources(data, status, sources, names, self._reasons)
        order = _stream_order(data, sources, names)
        if order is not None:
            status, num_tokens, raw_tokens, label_tokens, sources, format_codes = (
                column[order] for column in (status, num_tokens, raw_tokens, label_tokens, sources,
                                             self._formats.codes()))
        else:
            format_codes = self._formats.codes()
        counts = {name: int(np.count_nonzero(status == name)) for name in ROW_STATUSES}
        usable = np.isin(status, USABLE_STATUSES)
        malformed = _malformed_tally(status, order, self._reasons)
        formats = _format_counts(format_codes[status != RowStatus.MALFORMED], self._formats.values)
        per_source = np.bincount(self._sources.codes(), minlength=len(names)).tolist()
        read = dict(zip(names, per_source, strict=True))
        scan = DataScan(num_rows=len(status), lengths=num_tokens[usable], counts=counts,
                        label_tokens=int(label_tokens[usable].sum()), positions=np.flatnonzero(usable),
                        malformed=malformed, formats=formats,
                        sources=_source_stats(data, sources, names, usable, num_tokens) if order is not None
                        else {}, read=read)
        check_scan(data, scan, raw_tokens[status == RowStatus.TOO_LONG], max_length=max_length)
        return scan


def _stream_order(data: DataConfig, sources: np.ndarray, names: list[str]) -> np.ndarray | None:
    """The table row of each stream position with data.sources (scheduling/mix.py), None without."""
    spec = mix_spec(data)
    if spec is None:
        return None
    ids = tuple(entry.source_id for entry in data.sources)
    return stream_rows(sources, names, ids, spec).table_rows


def _malformed_tally(status: np.ndarray, order: np.ndarray | None, reasons: dict[int, str]) -> MalformedTally:
    """Malformed rows by reason over the stream (first: a stream position)."""
    bad = np.flatnonzero(status == RowStatus.MALFORMED)
    why = np.full(len(status), "", dtype=object)
    why[bad] = [reasons[int(order[p]) if order is not None else int(p)] for p in bad]
    tally = MalformedTally()
    tally.add(status, why)
    return tally


def _format_counts(codes: np.ndarray, names: list[str]) -> dict[str, int]:
    """Rows by format, most first; "" (a row no format read) not counted."""
    counts = {names[code]: int(n) for code, n in enumerate(np.bincount(codes, minlength=len(names))) if n}
    counts.pop("", None)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _source_stats(data: DataConfig, sources: np.ndarray, names: list[str], usable: np.ndarray,
                  num_tokens: np.ndarray) -> dict[str, dict[str, float]]:
    """{id: rows, usable_rows, tokens, share} over the stream, in data.sources' order."""
    total = max(len(sources), 1)
    code_of = {name: code for code, name in enumerate(names)}
    out = {}
    for entry in data.sources:
        mine = sources == code_of.get(entry.source_id, -1)
        out[entry.source_id] = {"rows": int(mine.sum()), "usable_rows": int((mine & usable).sum()),
                                "tokens": int(num_tokens[mine & usable].sum()),
                                "share": float(mine.sum() / total)}
    return out


def check_sources(data: DataConfig, status: np.ndarray, sources: np.ndarray, names: list[str],
                  reasons: dict[int, str]) -> None:
    """Each source on its own (table rows, in its order): a per-message field that no row can use (any
    data), and with data.sources a source without rows, with too many malformed rows or without a usable
    row: one DataError naming it (data.sources[i] and its id, or data.path) and the key."""
    field_error = next(((row, why) for row, why in sorted(reasons.items()) if FIELD_MARK in why), None)
    entries = list(data.sources)
    if field_error is not None:
        row, why = field_error
        name = names[int(sources[row])] if len(names) else ""
        index = next((i for i, entry in enumerate(entries) if entry.source_id == name), None)
        where = f"data.sources[{index}] ({name!r})" if index is not None else data_location(data)
        raise DataError(f"{where}: {why}; fix the field in the file (a per-message train must be true or "
                        "false, a weight 0 or 1)")
    code_of = {name: code for code, name in enumerate(names)}
    for index, entry in enumerate(entries):
        where = f"data.sources[{index}] ({entry.source_id!r}, data.sources[{index}].path={entry.path!r})"
        rows = np.flatnonzero(sources == code_of.get(entry.source_id, -1))
        if not len(rows):
            raise DataError(f"{where} gave no rows; check data.sources[{index}].path and its max_samples")
        mine = status[rows]
        tally = MalformedTally()
        tally.add(mine, [reasons.get(int(row), "") for row in rows])
        try:
            check_malformed(data, tally)
        except DataError as err:
            raise DataError(str(err).replace(data_location(data), where, 1)) from None
        if not np.isin(mine, USABLE_STATUSES).any():
            bad = ", ".join(f"{name}={int(n)}" for name, n in zip(*np.unique(mine, return_counts=True),
                                                                   strict=True))
            raise DataError(f"{where} has no usable row ({len(rows)} rows: {bad}); check its format_type / "
                            f"columns, data.labels={data.labels} and data.too_long")


def scan_dataset(dataset: Any, data: DataConfig, *, max_length: int) -> DataScan:
    """One pass over a tokenized Ray dataset's scan columns; DataError if it cannot train.

    `dataset` is `tokenized_dataset(...)` (the driver materializes a tokenizing one first, so the planner
    streams the same blocks and nothing is tokenized twice; a prepared one is read here for its small
    columns only). Errors: more malformed rows than data.max_malformed_fraction, any row longer than
    max_length with data.too_long=error, or no usable row at all (each names data.path), and per source
    (check_sources).
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
