"""The Ray Data pipeline of a run: read (or synthesize) -> tokenize, in a deterministic row order.

    data.source=path        read_parquet(files) | read_text(jsonl files) | from_arrow(load_from_disk)
    data.source=hf          from_arrow(load_dataset(data.path, data.name, data.split, data.data_files))
                            [-> repartition: from_arrow, several tasks]
                            blocks sized by bytes (block_counts: BLOCK_BYTES a block, >= 2 per task)
    data.sources            each source read as above (its file in a `path` column), [-> limit(its take)],
                            union of them all
                            -> map_batches(tokenize): one map, so data.tokenize_concurrency holds for the mix
    data.source=synthetic   range(data.num_samples) -> map_batches(synthesize_and_tokenize)
    data.source=prepared    read_parquet(the manifest's shards): the rows `data prepare` tokenized
                            (app/data/prepared.py), no map
    all                     -> rows {input_ids, labels, num_tokens, raw_tokens, label_tokens, status, reason,
                                     format, source}

The tokenize map runs `tasks` Ray tasks at once (`TaskPoolStrategy(size=tasks)`, resources.data_cpus each;
data.tokenize_concurrency, app/data/concurrency.py): Ray Data hands each task the next block, so many
blocks (a file read's own split: max(min(200, size / 1 MiB), 2 x CPUs) blocks; the streaming repartition of
an in-memory `datasets` table) keep every task busy until the end. Plain functions, not an actor pool
(app/data/ray_ops.py says why).

The planner numbers samples by their position in this stream and resumes by skipping a count, so the
pipeline sets `DataContext.preserve_order = True` (each operator hands its blocks on in input order,
whatever order its tasks finish in) and reads files in sorted order: the rows do not depend on `tasks`.
With several sources the union hands their blocks on round-robin (Ray Data's order with preserve_order),
which depends on how the reads cut their blocks; the run's stream does not: it is the weighted interleave
of each source's rows in their own order (scheduling/mix.py), whichever way the table holds them.
Everything that can be wrong with the input (missing path, unknown format, a tokenizer that does not load,
a manifest that disagrees with the config) was checked on the driver, before any Ray task starts, by
resolve_data (app/data/resolved.py), whose result the pipeline takes. Nothing here calls `ray.init`: the
caller owns the cluster.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any

import numpy as np

from app.config import DataConfig
from app.data import DataError
from app.data.ray_env import apply_executor_settings
from app.data.ray_ops import TOKENIZED_COLUMNS, ShardTarget, synthesize_and_tokenize, tokenize
from app.data.readers import PATH_COLUMN, DataSource, arrow_table
from app.data.resolved import ResolvedData
from app.data.sources import ResolvedSource
from app.data.template import TemplateSettings

BLOCK_BYTES = 2 << 20
"""Input bytes a tokenize block holds (~1 s of one core's work on JSON chats: ~2 MB/s with a Llama-3-style
tokenizer, 2026-11-28). A block costs a fixed ~0.07 s beside its rows (Ray Data's executor waits up to 0.1 s
for its tasks before it starts the next one; measured on 2 cores, 20,000 ~150-token chats, two tasks, warm:
2 or 4 blocks 3.45 s, 8 blocks 3.71 s, 16 blocks 3.89 s), so blocks sized by their bytes keep that small on
short rows, where Ray Data's own read split (2 x CPUs blocks at least) made blocks of ~0.7 s; on larger
files the blocks stay small enough that a long row (Ray Data splits a file into blocks of equal row counts)
leaves no task idle for long."""
BLOCKS_PER_TASK = 2
"""At least this many blocks per tokenize task: rows of unequal length make equal row counts unequal work,
and a second block per task evens the tail."""
PARQUET_EXPANSION = 3
"""Decoded bytes per Parquet byte, the estimate a block count is sized by (text compresses ~3x)."""


def tokenized_dataset(data: ResolvedData, *, num_cpus: float, tasks: int = 1,
                      write: ShardTarget | None = None) -> Any:
    """The run's tokenized rows as a lazy `ray.data.Dataset` (columns: see module docstring).

    `data` is what preflight resolved (app/data/resolved.py): its sources, template settings (with the
    run's longest sequence) and tokenizer were checked there, so nothing here can fail on bad input
    before Ray runs. num_cpus: what each Ray Data task reserves (resources.data_cpus). tasks: tokenize
    tasks at once (app/data/concurrency.py tokenize_tasks). write (`data prepare`): each task writes every
    block it tokenizes as one shard there (a call per block: batch_size None; data.tokenize_batch_size rows
    at a time inside it) and the dataset holds the shards' summaries (app/data/ray_ops.py write_shard), so
    the rows never cross the object store.
    """
    import ray.data

    if tasks < 1:
        raise ValueError(f"tasks={tasks}: at least one tokenize task")
    # `tasks` is a cap from the CPUs free: a dataset of fewer blocks runs fewer tasks, as it should, and
    # Ray Data need not say so on every small run
    warnings.filterwarnings("ignore", message=r"The maximum number of concurrent tasks for 'MapBatches\(",
                            category=UserWarning)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    apply_executor_settings()  # app/data/ray_env.py: every tokenize task from the start
    if write is not None:
        write = dataclasses.replace(write, batch_rows=data.config.tokenize_batch_size)
    if data.manifest is not None:
        # select_columns is pushed down into the Parquet read (no map of its own)
        shards = read_parquet(data.source.files, data.source.filesystem, num_cpus=num_cpus)
        return shards.select_columns(list(TOKENIZED_COLUMNS))
    if data.config.synthetic:
        return _synthetic_dataset(data.config, data.settings, num_cpus, tasks, write)
    rows = sources_dataset(data.sources, tasks)
    specs = tuple(source.spec(data.config.tokenizer) for source in data.sources)
    return rows.map_batches(
        tokenize, fn_kwargs={"sources": specs, "batch_rows": data.config.tokenize_batch_size, "write": write},
        batch_size=None, batch_format="pyarrow", compute=ray.data.TaskPoolStrategy(size=tasks),
        num_cpus=num_cpus,
    )


def sources_dataset(sources: tuple[ResolvedSource, ...], tasks: int) -> Any:
    """Every source's raw rows in blocks sized by bytes (block_counts), each cut to its `take`; several: each
    with its files in `path`, unioned."""
    mixed = len(sources) > 1
    tables = [arrow_table(source.data) if source.data.format not in ("parquet", "jsonl") else None
              for source in sources]
    sizes = [_input_bytes(source, table) for source, table in zip(sources, tables, strict=True)]
    counts = block_counts(sizes, tasks)
    datasets = []
    for source, table, blocks in zip(sources, tables, counts, strict=True):
        rows = _source_dataset(source.data, with_paths=mixed, blocks=blocks, table=table)
        if source.take is not None:
            rows = rows.limit(source.take)
        if tasks > 1 and table is not None:  # from_arrow is one block, which would feed a single task
            rows = rows.repartition(blocks)
        datasets.append(rows)
    return datasets[0].union(*datasets[1:]) if mixed else datasets[0]


def block_counts(sizes: list[float], tasks: int) -> list[int]:
    """Blocks to read each source in: BLOCK_BYTES of input a block, at least BLOCKS_PER_TASK per task over
    all sources (a multiple of `tasks`), shared by the sources in proportion to their bytes."""
    total = max(sum(sizes), 1.0)
    blocks = tasks * max(BLOCKS_PER_TASK, math.ceil(total / (tasks * BLOCK_BYTES)))
    return [max(1, round(blocks * size / total)) for size in sizes]


def _input_bytes(source: ResolvedSource, table: Any) -> float:
    """The bytes of input a source gives the tokenizer (its take's share of them)."""
    data = source.data
    if table is not None:
        size = float(table.nbytes)
    else:
        import pyarrow.fs as pafs

        filesystem = data.filesystem or pafs.LocalFileSystem()
        size = float(sum(info.size for info in filesystem.get_file_info(list(data.files))))
        size *= PARQUET_EXPANSION if data.format == "parquet" else 1
    if source.take is not None and data.num_rows:
        size *= min(1.0, source.take / data.num_rows)
    return size


def _synthetic_dataset(data: DataConfig, settings: TemplateSettings, num_cpus: float, tasks: int,
                       write: ShardTarget | None) -> Any:
    """range(data.num_samples) -> synthesized and tokenized rows."""
    import ray.data

    if data.num_samples < 1:
        raise DataError(f"data.num_samples={data.num_samples}: the synthetic source needs >= 1 sample")
    # One block per ~4k ids: Ray Data would otherwise start one 1-CPU read task per few rows.
    blocks = max(1, data.num_samples // 4096)
    synthesize = (data.tokenizer, data.distribution, data.num_samples, data.seed, data.length_scale)
    return ray.data.range(data.num_samples, override_num_blocks=blocks).map_batches(
        synthesize_and_tokenize,
        fn_kwargs={"synthesize": synthesize, "tokenize": (data.tokenizer, settings, False, SYNTHETIC),
                   "write": write},
        batch_size=data.tokenize_batch_size if write is None else None, batch_format="pyarrow",
        compute=ray.data.TaskPoolStrategy(size=tasks), num_cpus=num_cpus,
    )


SYNTHETIC = "synthetic"
"""The source id of the synthetic source's rows."""


def _source_dataset(source: DataSource, *, with_paths: bool = False, blocks: int | None = None,
                    table: Any = None) -> Any:
    """The rows of a resolved source, every column (JSONL: the raw lines in `text`), a file read in
    `blocks` blocks (None: Ray Data's choice); `with_paths`: each row's file in PATH_COLUMN (a `datasets`
    source, `table`: its first file, for every row).

    A `datasets` source (save_to_disk or load_dataset) goes in as the Arrow table resolve_source already
    loaded, which is what `ray.data.from_huggingface` does with a local Dataset, minus its first step: that
    one reloads the dataset by name and asks huggingface.co for a parquet export to read over HTTP instead
    (a second load, then HTTP requests that HF_HUB_OFFLINE does not stop, from the driver and Ray tasks).
    """
    import pyarrow as pa
    import ray.data

    if source.format == "parquet":
        return read_parquet(source.files, source.filesystem, include_paths=with_paths, blocks=blocks)
    if source.format == "jsonl":
        return ray.data.read_text(list(source.files), drop_empty_lines=True, filesystem=source.filesystem,
                                  include_paths=with_paths, override_num_blocks=blocks)
    table = arrow_table(source) if table is None else table
    if with_paths:
        marker = pa.DictionaryArray.from_arrays(pa.array(np.zeros(table.num_rows, np.int32)),
                                                pa.array([source.files[0]]))
        table = table.drop_columns([c for c in (PATH_COLUMN,) if c in table.column_names])
        table = table.append_column(PATH_COLUMN, marker.cast(pa.string()))
    return ray.data.from_arrow(table)


FOOTER_ACTORS_KNOB = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
"""Ray Data's size of the actor pool that reads parquet footers when a read is listed (32 by default)."""
FILES_PER_FOOTER_BATCH = 10
"""Files per footer-reading call (Ray Data's RAY_DATA_PARQUET_FOOTER_BATCH_SIZE default)."""
MAX_FOOTER_ACTORS = 32


def footer_actors(num_files: int) -> int:
    """Footer readers that `num_files` can keep busy: one per batch of files, at most Ray Data's default."""
    return max(1, min(MAX_FOOTER_ACTORS, math.ceil(num_files / FILES_PER_FOOTER_BATCH)))


def read_parquet(files: tuple[str, ...], filesystem: Any, *, num_cpus: float | None = None,
                 include_paths: bool = False, blocks: int | None = None) -> Any:
    """ray.data.read_parquet(files), with a footer-reader pool sized to the files.

    Ray Data's parquet reader lists its input by reading every footer on a pool of
    RAY_DATA_PARQUET_FOOTER_NUM_ACTORS actors (32 by default), each a Python process of its own (~2-3 s
    of CPU to start on a 2-core machine), fed batches of 10 files: a pool larger than the number of
    batches only costs start-ups (a one-file dataset started 4 of them on 2 cores, ~8 s of CPU per
    run, measured 2026-11-26). The read gets footer_actors(len(files)) unless the environment sets the
    knob; Ray Data reads it when the read is built (here, on the driver) and ships it with the plan.
    num_cpus: what each read task reserves (None: Ray Data's 1).
    """
    import ray.data

    def read() -> Any:
        return ray.data.read_parquet(list(files), filesystem=filesystem, num_cpus=num_cpus,
                                     include_paths=include_paths, override_num_blocks=blocks)

    if FOOTER_ACTORS_KNOB in os.environ:
        return read()
    os.environ[FOOTER_ACTORS_KNOB] = str(footer_actors(len(files)))
    try:
        return read()
    finally:
        del os.environ[FOOTER_ACTORS_KNOB]
