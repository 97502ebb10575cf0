"""`data prepare`'s work on Ray: tokenize the source once, every task writing its blocks as Parquet shards.

    tokenized_dataset(data, tasks=N, write=target)   N tokenize tasks at once; each writes every block it
                                                     tokenized as one shard (app/data/ray_ops.py
                                                     write_shard) and hands on only its summary rows
      -> iter_batches on the driver, in stream order  the summaries (the scan's columns + the shard's name)
      -> ShardList: the shards in stream order, with their row counts; ScanTally: counts by status and
         format, and the checks `train` runs before training
      -> the manifest record (app/data/prepared.py), for the caller to write last

The shards are written where they were tokenized, in parallel, and the tokenized rows never reach the
driver or the object store: the driver holds a few numbers a row (the scan) and the shard names, whatever
the dataset's size. Ray Data hands the summaries on in stream order (`preserve_order`), so the order of
the shard names, not their (random) names, is the stream order: the manifest lists them that way.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from app.data.prepared import FORMAT, VERSION, source_record
from app.data.ray_ops import SHARD_COLUMN, ShardTarget
from app.data.resolved import ResolvedData
from app.data.scan import SCAN_COLUMNS, DataScan, ScanTally


@dataclass
class ShardList:
    """[name, rows] of every shard in stream order, from summary blocks (consecutive rows of a shard)."""

    shards: list[list[Any]] = field(default_factory=list)

    def add(self, names: Iterable[str]) -> None:
        for name, rows in itertools.groupby(names):
            count = sum(1 for _ in rows)
            if self.shards and self.shards[-1][0] == name:  # a shard split across two summary blocks
                self.shards[-1][1] += count
            else:
                self.shards.append([name, count])


def write_prepared(data: ResolvedData, target: ShardTarget, *, num_cpus: float, tasks: int,
                   max_length: int) -> tuple[dict[str, Any], DataScan]:
    """Tokenize `data` on Ray with `tasks` tasks at once into shards under `target`; (manifest record, scan).

    DataError (before the manifest exists) when the rows could not train: the same checks as `train`'s
    scan (app/data/scan.py). The caller writes the manifest (the commit) and cleans up on failure.
    """
    from app.data.pipeline import tokenized_dataset

    dataset = tokenized_dataset(data, num_cpus=num_cpus, tasks=tasks, write=target)
    return fold_summaries(data, dataset.iter_batches(batch_size=None, batch_format="pyarrow"),
                          max_length=max_length)


def fold_summaries(data: ResolvedData, blocks: Iterable[Any], *,
                   max_length: int) -> tuple[dict[str, Any], DataScan]:
    """Summary blocks (pyarrow Tables from write_shard, stream order) -> (manifest record, scan)."""
    tally, shards = ScanTally(), ShardList()
    for block in blocks:
        tally.add({name: block.column(name).to_numpy(zero_copy_only=False) for name in SCAN_COLUMNS})
        shards.add(block.column(SHARD_COLUMN).to_pylist())
    scan = tally.scan(data.config, max_length=max_length)
    record = {
        "format": FORMAT, "version": VERSION, "rows": scan.num_rows, "shards": shards.shards,
        "counts": {status: n for status, n in scan.counts.items() if n}, "formats": scan.formats,
        "tokens": int(scan.lengths.sum()), "label_tokens": scan.label_tokens,
        "malformed": scan.malformed.as_json(),
        "sources": scan.source_rows(), "source": source_record(data.config, data.fingerprints),
        "identity": data.identity(),
    }
    return record, scan
