"""data.source=hf: one split of a hub dataset id or local dataset directory, through `datasets.load_dataset`.

    load_dataset(data.path, name=data.name or None, split=data.split, data_files=data.data_files or None)
        -> datasets.Dataset (memory-mapped Arrow files in the datasets cache)
        -> `plan`: its Arrow table, read locally (app/data/readers.py iter_local_rows)
        -> `train`: the same table as a Ray dataset (app/data/pipeline.py)

Everything a hub download involves (HF_HUB_OFFLINE, HF_DATASETS_CACHE / HF_HOME, HF_TOKEN, HF_ENDPOINT, a
hub id already cached being used offline) is `datasets`' own behavior; nothing here reimplements it.
What is added: every failure becomes one DataError naming the knob (data.path, data.name, data.split,
data.data_files, HF_HUB_OFFLINE), and a split is loaded once per driver process (an lru_cache keyed by
the four arguments): preflight, `plan` and the Ray pipeline all resolve the source, and a second
load_dataset would repeat the hub round trips and the cache lookups.
"""

from __future__ import annotations

import functools
from typing import Any

from app.config import DataConfig
from app.data import DataError


def load_split(data: DataConfig) -> Any:
    """The `datasets.Dataset` of data.split of data.path (cached per process); DataError naming the knob."""
    return _load(data.path, data.name or None, data.split or None, tuple(data.data_files))


def describe(data: DataConfig) -> str:
    """`data.path='...'` plus the load_dataset knobs that are set, for messages."""
    parts = [f"data.path={data.path!r}"]
    parts += [f"data.name={data.name!r}"] if data.name else []
    parts += [f"data.split={data.split!r}"]
    parts += [f"data.data_files={list(data.data_files)}"] if data.data_files else []
    return ", ".join(parts)


@functools.lru_cache(maxsize=8)
def _load(path: str, name: str | None, split: str | None, data_files: tuple[str, ...]) -> Any:
    import datasets

    try:
        loaded = datasets.load_dataset(path, name=name, split=split, data_files=list(data_files) or None)
    except (datasets.exceptions.DatasetsError, OSError, ValueError, RuntimeError) as err:
        raise _as_data_error(err, path, name, split, data_files) from None
    if not isinstance(loaded, datasets.Dataset):  # data.split "" gives every split (a DatasetDict)
        raise DataError(f"data.split must name one split of data.path={path!r} (available: {list(loaded)})")
    return loaded


def _as_data_error(err: Exception, path: str, name: str | None, split: str | None,
                   data_files: tuple[str, ...]) -> DataError:
    """The DataError for one load_dataset failure: what went wrong, in terms of the config knobs."""
    import datasets

    where = f"data.path={path!r}" + (f" (data.name={name!r})" if name else "")
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, ConnectionError):  # datasets' offline / unreachable-hub error, a ConnectionError
        return _unreachable(path, text)
    if isinstance(err, datasets.exceptions.DatasetNotFoundError):
        return DataError(f"{where} is not a dataset on the Hugging Face Hub, or it cannot be accessed "
                         f"({text}); check the id, log in (HF_TOKEN) for a gated or private dataset, or set "
                         "data.path to a local dataset directory")
    if isinstance(err, FileNotFoundError):  # also DataFilesNotFoundError: no (matching) data files
        files = f" matching data.data_files={list(data_files)}" if data_files else ""
        return DataError(f"{where}: no data files{files} ({text}); check data.path and data.data_files")
    if "Unknown split" in text:
        return DataError(f"data.split={split!r} is not a split of {where}; available splits: "
                         f"{_split_names(path, name, data_files) or text}")
    if "BuilderConfig" in text or "Config name is missing" in text:
        return DataError(f"data.name={name or ''!r} is not a configuration of data.path={path!r} ({text}); "
                         "set data.name to one of them")
    if "save_to_disk" in text:
        return DataError(f"data.path={path!r} is a `save_to_disk` directory: read it with data.source=path "
                         "(data.format=hf auto-detected) instead of data.source=hf")
    if "scripts are no longer supported" in text:
        return DataError(f"data.path={path!r} is a dataset loading script, which datasets "
                         f"{datasets.__version__} no longer runs ({text}); point data.path at the dataset's "
                         "data files (a directory of parquet/jsonl/csv files) or a hub id without a script")
    return DataError(f"{where}, data.split={split!r} cannot be loaded by datasets.load_dataset "
                     f"({type(err).__name__}: {text})")


def _unreachable(path: str, text: str) -> DataError:
    import datasets

    if datasets.config.HF_HUB_OFFLINE:
        return DataError(f"data.path={path!r} is not in the local datasets cache "
                         f"({datasets.config.HF_DATASETS_CACHE}) and HF_HUB_OFFLINE is set, so it cannot be "
                         "downloaded: load it once with network access (HF_HUB_OFFLINE unset), point "
                         "HF_DATASETS_CACHE / HF_HOME at the cache that holds it, or set data.path to a "
                         f"local dataset directory ({text})")
    return DataError(f"data.path={path!r}: the Hugging Face Hub cannot be reached ({text}); check the "
                     "network (HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to use a locally cached copy")


def _split_names(path: str, name: str | None, data_files: tuple[str, ...]) -> list[str]:
    """The splits datasets knows for the dataset (its builder's info, already prepared); [] if unknown."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(path, name=name, data_files=list(data_files) or None)
        return sorted(builder.info.splits or [])
    except Exception:  # noqa: BLE001 - only decorates an error message; datasets' own text is the fallback
        return []
