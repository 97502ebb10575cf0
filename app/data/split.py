"""The eval set of a run: held out of the training data (data.eval_fraction) or read apart (data.eval_path).

    data.eval_fraction = f   usable row at stream position p is eval  <=>  held_out(p, data.seed, f)
                             (scheduling/holdout.py); the planner's training stream skips exactly those
                             rows, so they are never trained on and never appear in samples.jsonl
    data.eval_path = P       a second dataset, read and tokenized by the same readers, template and
                             tokenizer (data.format, data.too_long, ... apply to it too); its sample ids
                             are positions in *its* stream, a space of their own that samples.jsonl
                             never holds

Why the split is by stream position and not a Ray Data filter: a sample's id *is* its position in the
deterministic tokenized stream (the planner numbers rows as it reads them), and Ray Data has no global row
index to filter on; the planner's in-order reader is the one place that knows positions. Both the driver's
row counts (here) and the planner (scheduling/actor.py) call the same pure `held_out`, so they agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from app.config import ConfigError, DataConfig
from app.data import DataError
from scheduling.holdout import held_out
from workers.storage import redact_text, redact_uri


@dataclass(frozen=True, slots=True)
class SplitCounts:
    """Usable rows of one epoch that train, and usable rows of the eval set."""

    train_rows: int
    eval_rows: int


def eval_data_config(data: DataConfig) -> DataConfig:
    """The DataConfig that reads data.eval_path with the run's readers, template and tokenizer."""
    return dataclasses.replace(data, source="path", path=data.eval_path, eval_path="", eval_fraction=0.0,
                               sources=())


def as_eval_path_error(err: DataError, data: DataConfig) -> DataError:
    """A reader's error about the eval dataset, naming data.eval_path (the readers only know data.path)."""
    message = str(err).replace("data.path", "data.eval_path")
    if "data.eval_path" not in message:
        message = f"{message} (data.eval_path={redact_uri(data.eval_path)!r})"
    return DataError(redact_text(message, data.eval_path))


def split_counts(positions: np.ndarray, data: DataConfig, *, eval_path_rows: int = 0) -> SplitCounts:
    """Training and eval row counts, given the stream positions of the training dataset's usable rows.

    With data.eval_fraction the eval rows are the held-out positions; with data.eval_path they are the
    usable rows of that dataset (`eval_path_rows`). ConfigError naming the key when an eval set is asked
    for but holds no sample (the eval loss would be 0/0), or when no training row is left.
    """
    mask = held_out(positions, seed=data.seed, fraction=data.eval_fraction)
    counts = SplitCounts(train_rows=int(np.count_nonzero(~mask)),
                         eval_rows=int(np.count_nonzero(mask)) if data.eval_fraction else eval_path_rows)
    if data.eval_fraction and counts.eval_rows == 0:
        raise ConfigError(f"data.eval_fraction={data.eval_fraction} holds out no sample of the "
                          f"{len(positions)} usable rows; raise data.eval_fraction or add data")
    if data.eval_path and counts.eval_rows == 0:
        raise ConfigError(f"data.eval_path={data.eval_path!r} has no usable row; point data.eval_path at "
                          "a dataset with labelled rows")
    if counts.train_rows == 0:
        raise ConfigError(f"data.eval_fraction={data.eval_fraction} holds out every one of the "
                          f"{len(positions)} usable rows; lower data.eval_fraction")
    return counts
