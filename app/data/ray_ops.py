"""The functions Ray Data runs in `map_batches`, and the classes behind them.

    ray.data.range(n) --SynthesizeBatch--> {sample_id, messages}          (data.source: synthetic)
    read_parquet / read_text / from_arrow --> {every column of the rows | json_line rows}
        [several sources: each read with its file in a `path` column, the reads unioned]
        --SourcesTokenizer: each row's source (by its file), that source's TokenizeBatch-->
        {input_ids list<int32>, labels list<int32>, num_tokens, raw_tokens, label_tokens,
         status, reason ("" unless status is malformed), format (the row format), source (its source's id)}
        [--write_shard--> the block as one Parquet shard; returned: its scan columns + `shard` (its name)]

A call gets a whole block (`batch_size=None`: a union's blocks each come from one source, and Ray Data would
otherwise concatenate rows of two sources' schemas into one batch) and yields the tokenized rows a slice at
a time (Ray Data gathers them into output blocks, so a task holds one slice of output at a time, not its
block's). A slice is data.tokenize_batch_size rows, or more when they are short: about SLICE_BYTES of input
(slice_rows), since each tokenize call has a fixed cost (template and tokenizer setup, a batch encode,
building Arrow columns) that 64 rows of ~150 tokens pay ~10% on.

`tokenize` and `synthesize_and_tokenize` are plain functions, so Ray Data runs them as tasks (an actor-pool
map would be a process of its own beside the read task, ~2-4 s of CPU to start); each builds its classes
once per worker process (the constructors load the tokenizer), keyed by their arguments (fixed for a job,
whose task workers Ray reuses). One task, one core: the tokenizer encodes single-threaded there (the
qwen vocabulary's batch threads; HF tokenizers' Rayon pool through TOKENIZERS_PARALLELISM=false unless
the environment sets it), since the tasks are the parallelism (data.tokenize_concurrency,
resources.data_cpus each): a task's extra threads only contend with the other tasks. Both take and return
pyarrow Tables (`batch_format="pyarrow"`); the token columns are built as Arrow list arrays from one flat
int32 buffer plus offsets, not from per-row Python lists. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from app.data.readers import PATH_COLUMN
from app.data.synth import ConversationSynth, synth_conversations, target_lengths
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
TOKENIZED_COLUMNS = ("input_ids", "labels", "num_tokens", "raw_tokens", "label_tokens", "status", "reason",
                     "format", "source")

"""A tokenized row (TokenizeBatch's output): what the planner, the scan and `data prepare` read."""


class SynthesizeBatch:
    """Batch of `ray.data.range` ids -> synthetic conversations of the configured target lengths.

    The targets of all num_samples are drawn once in the constructor (same seed as `data synth`), so
    a row depends only on its id: the in-memory source equals `data synth --n num_samples` row for row.
    """

    def __init__(self, tokenizer: str, distribution: str, num_samples: int, seed: int,
                 length_scale: float) -> None:
        self.synth = ConversationSynth(load_tokenizer(tokenizer))
        self.distribution = distribution
        self.seed = seed
        self.targets = target_lengths(distribution, num_samples, seed, length_scale)

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column("id").to_numpy().astype(np.int64)
        conversations = synth_conversations(self.synth, ids, self.targets[ids], self.distribution, self.seed)
        return pa.table({"sample_id": pa.array(ids, pa.int64()),
                         "messages": pa.array(conversations, MESSAGES_TYPE)})


class TokenizeBatch:
    """Batch of rows -> tokenized rows (see app/data/template.py for the template, labels and statuses).

    json_lines: the batch is `ray.data.read_text` output whose `text` column holds raw JSONL lines.
    """

    def __init__(self, tokenizer: str, settings: TemplateSettings, json_lines: bool = False,
                 source: str = "") -> None:
        self.tok = load_tokenizer(tokenizer)
        self.settings = settings
        self.json_lines = json_lines
        self.source = source

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = tokenize_rows(self._rows(batch), self.tok, self.settings)
        source = pa.DictionaryArray.from_arrays(pa.array(np.zeros(batch.num_rows, np.int32)),
                                                pa.array([self.source]))
        return pa.table({
            "input_ids": int32_lists(out.input_ids), "labels": int32_lists(out.labels),
            "num_tokens": pa.array(out.num_tokens, pa.int64()),
            "raw_tokens": pa.array(out.raw_tokens, pa.int64()),
            "label_tokens": pa.array(out.label_tokens, pa.int64()),
            "status": pa.array(out.status, pa.string()),
            "reason": pa.array(out.reason, pa.string()),
            "format": pa.array(out.format, pa.string()),
            "source": source.cast(pa.string()),
        })

    def _rows(self, batch: pa.Table) -> list[dict[str, Any]]:
        if self.json_lines:
            return [{"json_line": line} for line in batch.column("text").to_pylist()]
        return batch.to_pylist()  # every column: the row format decides which it reads (app/data/formats/)


@dataclass(frozen=True)
class ShardTarget:
    """`data prepare`: the directory (a local path or a URI, workers/storage.py Location) a tokenize task
    writes each block into, as one Parquet shard named `{prefix}{random hex}.parquet`, tokenizing
    `batch_rows` rows at a time (data.tokenize_batch_size) so that a task's memory does not grow with its
    block."""

    directory: str
    prefix: str = "part-"
    batch_rows: int = 64


SHARD_COLUMN = "shard"
"""The summary a shard-writing task returns instead of its rows: the scan's columns (app/data/scan.py) and
the name of the shard every row went into (dictionary-encoded: one string a block)."""


ROW_GROUP_BYTES = 32 << 20
"""Tokenized bytes a shard's row group gathers before it is written: a reader (Ray Data's Parquet read, the
planner's RowTable) gets blocks of thousands of rows, not one per tokenize batch (64 rows gave 15,645 blocks
for 1M rows, and a 41 s, 1 GB index), while a task holds at most this much of its block at once."""


def write_shard(rows: pa.Table, tokenize: Callable[[pa.Table], pa.Table], target: ShardTarget) -> pa.Table:
    """Tokenize `rows` (a block) target.batch_rows at a time into one shard under `target`, in row groups
    of about ROW_GROUP_BYTES; the block's summary rows (SHARD_COLUMN)."""
    import uuid

    import pyarrow.parquet as pq

    from app.data.scan import SCAN_COLUMNS
    from workers.storage import Location

    name = f"{target.prefix}{uuid.uuid4().hex}.parquet"
    summaries: list[pa.Table] = []
    if rows.num_rows:
        where = Location.of(target.directory)
        with where.filesystem.open_output_stream(f"{where.path}/{name}") as stream:
            writer, group, grouped = None, [], 0
            for start in range(0, rows.num_rows, target.batch_rows):
                out = tokenize(rows.slice(start, target.batch_rows))
                writer = writer or pq.ParquetWriter(stream, out.schema, compression="zstd")
                group.append(out)
                grouped += out.nbytes
                summaries.append(out.select(list(SCAN_COLUMNS)))
                if grouped >= ROW_GROUP_BYTES:
                    writer.write_table(pa.concat_tables(group))
                    group, grouped = [], 0
            if group:
                writer.write_table(pa.concat_tables(group))
            writer.close()
    summary = pa.concat_tables(summaries) if summaries else tokenize(rows).select(list(SCAN_COLUMNS))
    shard = pa.DictionaryArray.from_arrays(pa.array(np.zeros(summary.num_rows, np.int32)), pa.array([name]))
    return summary.append_column(SHARD_COLUMN, shard)


class SourcesTokenizer:
    """Rows of one or several sources -> tokenized rows, each row by its own source's TokenizeBatch.

    `sources`: per source (tokenizer, TemplateSettings, json_lines, id, its files) (app/data/sources.py
    ResolvedSource.spec). With several, a row's source is the one whose files hold its `path`; the rows of
    a block come from one read, so they are tokenized in runs of one source.
    """

    def __init__(self, sources: tuple[tuple[Any, ...], ...]) -> None:
        self.batches = [_tokenizer_of(*spec[:4]) for spec in sources]
        self.by_file = {file: index for index, spec in enumerate(sources) for file in spec[4]}

    def __call__(self, batch: pa.Table) -> pa.Table:
        if len(self.batches) == 1:
            return self.batches[0](batch)
        rows = batch.drop_columns([PATH_COLUMN])  # a mix reads every source with it
        if not batch.num_rows:
            return self.batches[0](rows)
        which = self._sources(batch.column(PATH_COLUMN))
        starts = np.flatnonzero(np.diff(which, prepend=-1))
        ends = np.append(starts[1:], len(which))
        return pa.concat_tables([self.batches[which[start]](rows.slice(start, end - start))
                                 for start, end in zip(starts, ends, strict=True)])

    def _sources(self, paths: Any) -> np.ndarray:
        """The source index of each row, from its file."""
        encoded = (paths.combine_chunks() if hasattr(paths, "combine_chunks") else paths).dictionary_encode()
        files = encoded.dictionary.to_pylist()
        unknown = [file for file in files if file not in self.by_file]
        if unknown:
            raise RuntimeError(f"a row of file {unknown[0]!r}, which no source reads")
        index = np.asarray([self.by_file[file] for file in files], dtype=np.int64)
        return index[encoded.indices.to_numpy(zero_copy_only=False)]


SLICE_BYTES = 256 << 10
"""Input bytes a tokenize call gets at least (~60k tokens of JSON chat), unless tokenize_batch_size rows are
more."""


def slice_rows(block: pa.Table, batch_rows: int) -> int:
    """Rows per tokenize call over `block`: batch_rows, or as many as make SLICE_BYTES of its rows."""
    if not block.num_rows:
        return batch_rows
    return max(batch_rows, int(SLICE_BYTES * block.num_rows // max(block.nbytes, 1)))


def tokenize(batch: pa.Table, sources: tuple[tuple[Any, ...], ...], batch_rows: int = 64,
             write: ShardTarget | None = None) -> Iterator[pa.Table]:
    """SourcesTokenizer(sources) over a block, slice_rows(block, batch_rows) rows at a time (with `write`:
    the block written as a shard, and its summary yielded)."""
    tokenizer = _sources_tokenizer_of(sources)
    rows = slice_rows(batch, batch_rows)
    if write is not None:
        yield write_shard(batch, tokenizer, dataclasses.replace(write, batch_rows=rows))
        return
    for start in range(0, max(batch.num_rows, 1), rows):
        yield tokenizer(batch.slice(start, rows))


def synthesize_and_tokenize(batch: pa.Table, synthesize: tuple[Any, ...], tokenize: tuple[Any, ...],
                            write: ShardTarget | None = None) -> pa.Table:
    """SynthesizeBatch(*synthesize), then TokenizeBatch(*tokenize): the synthetic source in one task."""
    rows, tokenizer = _synthesizer_of(*synthesize)(batch), _tokenizer_of(*tokenize)
    return tokenizer(rows) if write is None else write_shard(rows, tokenizer, write)


@functools.lru_cache(maxsize=4)
def _sources_tokenizer_of(sources: tuple[tuple[Any, ...], ...]) -> SourcesTokenizer:
    return SourcesTokenizer(sources)


@functools.lru_cache(maxsize=4)
def _synthesizer_of(*args: Any) -> SynthesizeBatch:
    return SynthesizeBatch(*args)


@functools.lru_cache(maxsize=4)
def _tokenizer_of(*args: Any) -> TokenizeBatch:
    """The process's TokenizeBatch for these arguments, single-threaded (see the module docstring)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    batch = TokenizeBatch(*args)
    batch.tok = dataclasses.replace(batch.tok, threads=1)  # a copy: the cached tokenizer keeps its threads
    return batch


def int32_lists(arrays: list[np.ndarray]) -> pa.ListArray:
    """Arrow list<int32> from per-row int32 arrays: one concatenated buffer plus int32 offsets."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int32, copy=False)))
