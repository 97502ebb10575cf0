"""`data prepare`'s work on Ray: tokenize the source once, stream the rows into Parquet shards, count them.

    tokenized_dataset(data, tasks=N)          N tokenize tasks at once, rows in stream order
      -> iter_batches(batch_size=None)        each block as Ray Data hands it on, in stream order
      -> ShardWriter: part-NNNNN.parquet      SHARD_ROWS rows a shard (zstd), written by the driver
      -> ScanTally                            counts by status and format; the checks `train` runs
      -> the manifest record                  (app/data/prepared.py) for the caller to write last

The driver writes the shards itself rather than through Ray Data's write_parquet: the shard names and the
manifest's row counts must follow the stream order the planner numbers samples by, and Ray Data names its
files by write task, whose order it does not promise. The driver holds one block at a time (plus the scan's
few numbers a row), so its memory does not grow with the dataset.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from app.data.prepared import FORMAT, SHARD_ROWS, VERSION, source_record
from app.data.resolved import ResolvedData
from app.data.scan import SCAN_COLUMNS, DataScan, ScanTally


@dataclass
class ShardWriter:
    """Parquet shards of `shard_rows` rows in `directory` of `filesystem`, named `{prefix}NNNNN.parquet`."""

    filesystem: Any
    directory: str
    prefix: str = "part-"
    shard_rows: int | None = None
    """Rows a shard (None: SHARD_ROWS)."""
    shards: list[tuple[str, int]] = field(default_factory=list)
    _writer: Any = None
    _rows: int = 0

    def __post_init__(self) -> None:
        self.shard_rows = self.shard_rows or SHARD_ROWS

    def write(self, table: Any) -> None:
        """Append the next rows (a pyarrow Table), starting a new shard every `shard_rows` rows."""
        start = 0
        while start < table.num_rows:
            if self._writer is None:
                self._open(table.schema)
            take = min(self.shard_rows - self._rows, table.num_rows - start)
            self._writer.write_table(table.slice(start, take))
            self._rows += take
            start += take
            if self._rows == self.shard_rows:
                self._close_shard()

    def close(self) -> list[tuple[str, int]]:
        """Finish the last shard; (name, rows) of every shard in stream order."""
        if self._writer is not None:
            self._close_shard()
        return list(self.shards)

    def _open(self, schema: Any) -> None:
        import pyarrow.parquet as pq

        name = f"{self.prefix}{len(self.shards):05d}.parquet"
        stream = self.filesystem.open_output_stream(f"{self.directory}/{name}")
        self._writer = pq.ParquetWriter(stream, schema, compression="zstd")
        self.shards.append((name, 0))
        self._stream = stream

    def _close_shard(self) -> None:
        self._writer.close()
        self._stream.close()
        self.shards[-1] = (self.shards[-1][0], self._rows)
        self._writer, self._rows = None, 0


def write_prepared(data: ResolvedData, writer: ShardWriter, *, num_cpus: float, tasks: int,
                   max_length: int) -> tuple[dict[str, Any], DataScan]:
    """Tokenize `data` on Ray with `tasks` tasks at once into `writer`'s shards; (manifest record, scan).

    DataError (before the manifest exists) when the rows could not train: the same checks as `train`'s
    scan (app/data/scan.py). The caller writes the manifest (the commit) and cleans up on failure.
    """
    from app.data.pipeline import tokenized_dataset

    dataset = tokenized_dataset(data, num_cpus=num_cpus, tasks=tasks)
    blocks = dataset.iter_batches(batch_size=None, batch_format="pyarrow")
    return write_blocks(data, blocks, writer, max_length=max_length)


def write_blocks(data: ResolvedData, blocks: Iterable[Any], writer: ShardWriter, *,
                 max_length: int) -> tuple[dict[str, Any], DataScan]:
    """Tokenized blocks (pyarrow Tables, stream order) into `writer`'s shards; (manifest record, scan)."""
    tally = ScanTally()
    for block in blocks:
        tally.add({name: block.column(name).to_numpy(zero_copy_only=False) for name in SCAN_COLUMNS})
        writer.write(block)
    shards = writer.close()
    scan = tally.scan(data.config, max_length=max_length)
    record = {
        "format": FORMAT, "version": VERSION, "rows": scan.num_rows,
        "shards": [[name, rows] for name, rows in shards],
        "counts": {status: n for status, n in scan.counts.items() if n}, "formats": scan.formats,
        "tokens": int(scan.lengths.sum()), "label_tokens": scan.label_tokens,
        "malformed": scan.malformed.as_json(),
        "source": source_record(data.config, data.fingerprints["data.path"]),
        "identity": data.identity(),
    }
    return record, scan
