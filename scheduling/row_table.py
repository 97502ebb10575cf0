"""Random access by stream position to a tokenized dataset's rows: the planner's view of the data.

A shuffled epoch (scheduling/order.py) visits the rows in a permuted order, so the planner needs row p of
the stream without reading the stream up to p. It reads the materialized dataset once, block by block
(`iter_batches(batch_size=None, batch_format="pyarrow")`: each block as Ray fetched it from the object
store, in stream order, slices applied) and keeps of every block only the three columns it plans with:

    block k = stream rows starts[k] .. starts[k+1]-1, as Arrow record batches
        input_ids, labels: offsets (n+1) and values     numpy views of the Arrow buffers, no copy
        status, source:    one int16 code per row each   (copies: 2 bytes a row each; source: the id of
                                                          the data.sources entry the row came from)
    row p:  k = searchsorted(starts, p, side=right) - 1,  j = p - starts[k]
            input_ids = values[offsets[j] : offsets[j+1]]

Arrow list arrays keep absolute offsets into their (unsliced) child values, which is why a sliced block
needs no special case. Blocks that Ray fetched zero-copy stay mapped from the object store (the driver's
materialized dataset keeps them there anyway), so holding all of them costs 2 bytes per row of status
codes; a lookup is a binary search over blocks and two slices (~16 us a row, docs/design.md §10).

Pure: numpy only (the Arrow objects are used through their methods), so it is tested without Ray.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduling.payload import RowStatus

PLANNER_COLUMNS = ("input_ids", "labels", "status", "source")
"""What the planner reads of a tokenized row (app/data/ray_ops.py writes them)."""


@dataclass(frozen=True, slots=True)
class _ListColumn:
    """One block's list column: Arrow's offsets and values as numpy views (or the Arrow array itself
    when it is not a list array, read row by row)."""

    offsets: np.ndarray | None
    values: Any

    @classmethod
    def of(cls, array: Any) -> _ListColumn:
        if hasattr(array, "offsets") and hasattr(array, "values"):
            return cls(array.offsets.to_numpy(zero_copy_only=False),
                       array.values.to_numpy(zero_copy_only=False))
        return cls(None, array)

    def row(self, j: int) -> np.ndarray:
        if self.offsets is None:
            return np.asarray(self.values[j].as_py(), dtype=np.int64)
        return np.asarray(self.values[self.offsets[j]:self.offsets[j + 1]], dtype=np.int64)


@dataclass(frozen=True, slots=True)
class _Block:
    input_ids: _ListColumn
    labels: _ListColumn


class RowTable:
    """Rows of a tokenized stream by position (see module docstring): `status(p)` and `tokens(p)`."""

    def __init__(self, blocks: list[_Block], starts: np.ndarray, status_codes: np.ndarray,
                 status_names: list[str], source_codes: np.ndarray | None = None,
                 source_names: list[str] | None = None) -> None:
        self._blocks = blocks
        self._starts = starts
        self._status_codes = status_codes
        self._status_names = status_names
        self.source_codes = np.zeros(len(status_codes), np.int16) if source_codes is None else source_codes
        """Each row's source as a code into `source_names`."""
        self.source_names = source_names or [""]
        """The source ids the rows carry ("" for rows without a `source` column)."""

    @classmethod
    def from_tables(cls, tables: Iterable[Any]) -> RowTable:
        """Index pyarrow tables (or record batches) holding the stream's rows in order.

        A table without a `status` column reads as all "ok" (the planner's default for a row without one),
        one without a `source` column as source "".
        """
        blocks: list[_Block] = []
        counts: list[int] = []
        codes: list[np.ndarray] = []
        names: dict[str, int] = {}
        source_codes: list[np.ndarray] = []
        sources: dict[str, int] = {}
        for table in tables:
            for batch in table.to_batches() if hasattr(table, "to_batches") else [table]:
                if batch.num_rows == 0:
                    continue
                blocks.append(_Block(_ListColumn.of(batch.column("input_ids")),
                                     _ListColumn.of(batch.column("labels"))))
                counts.append(batch.num_rows)
                codes.append(_codes(batch, "status", RowStatus.OK.value, names))
                source_codes.append(_codes(batch, "source", "", sources))
        starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        status_codes = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int16)
        source_array = np.concatenate(source_codes) if source_codes else np.zeros(0, dtype=np.int16)
        return cls(blocks, starts, status_codes, list(names), source_array, list(sources))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def status(self, position: int) -> str:
        return self._status_names[self._status_codes[position]]

    def tokens(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) of stream row `position`, as int64 arrays."""
        if not 0 <= position < len(self):
            raise IndexError(f"row {position} of a stream of {len(self)} rows")
        k = int(np.searchsorted(self._starts, position, side="right")) - 1
        block, j = self._blocks[k], position - int(self._starts[k])
        return block.input_ids.row(j), block.labels.row(j)


def _codes(batch: Any, column: str, missing: str, names: dict[str, int]) -> np.ndarray:
    """The batch's string `column` as codes into `names` (extended with the values seen for the first
    time); every row `missing` when the batch has no such column."""
    if column not in batch.schema.names:
        strings = np.full(batch.num_rows, missing)
    else:
        strings = np.asarray(batch.column(column).to_numpy(zero_copy_only=False)).astype(str)
    unique, inverse = np.unique(strings, return_inverse=True)
    mapping = np.asarray([names.setdefault(str(name), len(names)) for name in unique], dtype=np.int16)
    return mapping[inverse.reshape(-1)]
