"""A run's tokenized data on Ray: tokenized once, scanned, split into training and eval rows.

    ResolvedData (preflight) ─▶ tokenized_dataset(..., tasks=cluster_tokenize_tasks(...)).materialize()
        ─▶ scan_dataset (too long? empty? malformed?) ─▶ the data summary (terminal,
        <run_dir>/data_summary.json) ─▶ split_counts (eval rows)

The scan and the planner's stream read the same materialized blocks (the object store spills them to disk
when they outgrow memory), so nothing is tokenized twice. A prepared set (data.source=prepared) is not
materialized: it is on disk already, the scan reads its small columns and the planner streams the shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from app.config import SkrullConfig

if TYPE_CHECKING:
    from ray.data import Dataset

    from app.data.resolved import ResolvedData
    from app.data.scan import DataScan


@dataclass(frozen=True, slots=True)
class PreparedData:
    dataset: Dataset
    """The materialized tokenized training dataset (held-out rows included: the planner skips them)."""
    usable_rows: int
    """Usable rows of one epoch that train (data.eval_fraction's held-out rows excluded)."""
    eval_dataset: Dataset | None = None
    """data.eval_path's materialized tokenized rows, or None (no eval set, or held out of `dataset`)."""
    eval_rows: int = 0
    """Usable rows of the eval set (0: none)."""


def prepared_data(config: SkrullConfig, data: ResolvedData, *, progress: bool, out: TextIO, embedded: bool,
                  planners: int = 1, run_dir: Path | None = None) -> PreparedData:
    """Check the cluster fits, tokenize once (materialized; a prepared set as it is), scan it, split off the
    eval set.

    The scan stops the run here, before the planner and the workers start, when more than
    data.max_malformed_fraction of the rows read are malformed (a DataError naming data.path, the fraction
    and the most common reason: app/data/malformed.py).

    `planners`: how many planner actors the run starts (each reserves resources.planner_cpus).
    data.eval_path is tokenized and scanned the same way (its errors name data.eval_path); an eval set
    without a sample is a ConfigError (app/data/split.py). With `run_dir`, the data summary is also
    written to <run_dir>/data_summary.json (app/rundir/files.py; `report` shows it).
    """
    import ray

    from app.data.concurrency import cluster_tokenize_tasks
    from app.data.split import split_counts
    from app.train.preflight import check_cluster_fits, check_epoch_fits

    resources = dataclasses.replace(config.resources, planner_cpus=config.resources.planner_cpus * planners)
    sized = dataclasses.replace(config, resources=resources)
    warning = check_cluster_fits(sized, ray.cluster_resources(), embedded=embedded)
    if warning:
        print(warning, file=out, flush=True)
    tasks = cluster_tokenize_tasks(sized)  # app/data/concurrency.py: what training leaves
    dataset, scan = _tokenized_and_scanned(config, data, tasks)
    if progress:
        print(scan.summary(), file=out, flush=True)
        _log_example_row(dataset, data)
    eval_dataset, eval_path_rows = _eval_path_dataset(config, data, tasks, progress=progress, out=out)
    counts = split_counts(scan.positions, config.data, eval_path_rows=eval_path_rows)
    if progress and config.data.eval_fraction:
        print(f"eval: {counts.eval_rows} rows held out (data.eval_fraction={config.data.eval_fraction}), "
              f"{counts.train_rows} train", file=out, flush=True)
    check_epoch_fits(config, counts.train_rows)
    if run_dir is not None:
        from app.rundir.files import data_summary, write_data_summary

        summary = data_summary(scan, train_rows=counts.train_rows, eval_rows=counts.eval_rows)
        write_data_summary(run_dir, summary)
    return PreparedData(dataset=dataset, usable_rows=counts.train_rows, eval_dataset=eval_dataset,
                        eval_rows=counts.eval_rows)


def _tokenized_and_scanned(config: SkrullConfig, data: ResolvedData, tasks: int) -> tuple[Dataset, DataScan]:
    """(the tokenized dataset, its scan): materialized when tokenized here, the shards when prepared."""
    from app.data.pipeline import tokenized_dataset
    from app.data.scan import scan_dataset

    dataset = tokenized_dataset(data, num_cpus=config.resources.data_cpus, tasks=tasks)
    if data.manifest is None:
        dataset = dataset.materialize()
    return dataset, scan_dataset(dataset, config.data, max_length=config.max_sequence_length)


def _log_example_row(dataset: Dataset, data: ResolvedData) -> None:
    """One training row, decoded, loss-bearing text in [[ ]], to stdout: the run's log under a quiet terminal
    (app/train/console.py), so what the model trains on is on record without cluttering the terminal."""
    from app.data.preview import first_usable_example, prepared_rows

    rows = dataset.iter_rows() if data.manifest is None else prepared_rows(data.source)
    example = first_usable_example(rows, data.tokenizer)
    if example is not None:
        print(f"example training row (loss on [[...]]):\n{example}", flush=True)


def _eval_path_dataset(config: SkrullConfig, data: ResolvedData, tasks: int, *, progress: bool,
                       out: TextIO) -> tuple[Any, int]:
    """(materialized data.eval_path rows, usable rows), or (None, 0) without data.eval_path."""
    from app.data import DataError
    from app.data.pipeline import tokenized_dataset
    from app.data.scan import scan_dataset
    from app.data.split import as_eval_path_error

    eval_data = data.eval_data()
    if eval_data is None:
        return None, 0
    try:
        dataset = tokenized_dataset(eval_data, num_cpus=config.resources.data_cpus, tasks=tasks).materialize()
        scan = scan_dataset(dataset, eval_data.config, max_length=config.max_sequence_length)
    except DataError as err:
        raise as_eval_path_error(err, config.data) from None
    if progress:
        print(scan.summary().replace("data:", "eval data:", 1), file=out, flush=True)
    return dataset, scan.num_usable
