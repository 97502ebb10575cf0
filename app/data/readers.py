"""Dataset formats on disk: detection, ordered file lists, and Ray-free row batches.

    data.format   data.path                              rows
    parquet       file.parquet | dir of *.parquet         `messages` and/or `text` columns
    jsonl         file.jsonl | dir of *.jsonl            one JSON object per line (blank lines skipped)
    hf            `datasets` save_to_disk directory      `messages` and/or `text` columns
    auto          hf if the dir holds dataset_info.json / state.json / dataset_dict.json, else by suffix

Files of a directory are read in sorted path order (nested dirs included), so the row stream, and with it
the planner's sample ids, is the same on every run. JSONL lines are handed on raw (`json_line`) and parsed
by the tokenizer, so one bad line is a counted `malformed` row instead of a failed read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.config import DataConfig
from app.data import DataError

ROW_COLUMNS = ("messages", "text")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclass(frozen=True)
class DataSource:
    """A resolved dataset on disk: its format, its files in read order (hf: the directory) and columns."""

    format: str
    files: tuple[str, ...]
    columns: tuple[str, ...]


def resolve_source(data: DataConfig) -> DataSource:
    """Check data.path, detect data.format, list files in order; DataError naming the knob on failure."""
    if not data.path:
        raise DataError("data.source=path needs data.path (a parquet, jsonl or HF dataset directory)")
    path = Path(data.path).expanduser()
    if not path.exists():
        raise DataError(f"data.path={data.path!r} does not exist (looked at {path.resolve()})")
    fmt = data.format if data.format != "auto" else _detect_format(path)
    if fmt == "hf":
        if not path.is_dir():
            raise DataError(f"data.format=hf needs a save_to_disk directory; data.path={data.path!r}")
        return DataSource(format="hf", files=(str(path),), columns=_hf_columns(str(path)))
    suffix = ".parquet" if fmt == "parquet" else ".jsonl"
    files = _list_files(path, (suffix, ".json") if fmt == "jsonl" else (suffix,))
    if not files:
        raise DataError(f"data.path={data.path!r} holds no {suffix} files (data.format={data.format})")
    columns = ROW_COLUMNS if fmt == "jsonl" else _parquet_columns(files[0])
    return DataSource(format=fmt, files=files, columns=columns)


def _detect_format(path: Path) -> str:
    if path.is_dir():
        if any((path / marker).exists() for marker in _HF_MARKERS):
            return "hf"
        suffixes = {p.suffix for p in path.rglob("*") if p.is_file()}
        found = [fmt for suffix, fmt in _SUFFIXES.items() if suffix in suffixes]
    else:
        found = [_SUFFIXES[path.suffix]] if path.suffix in _SUFFIXES else []
    if len(set(found)) != 1:
        raise DataError(
            f"cannot detect the format of data.path={str(path)!r} (found {sorted(set(found)) or 'nothing'}); "
            "set data.format to parquet, jsonl or hf"
        )
    return found[0]


def _list_files(path: Path, suffixes: tuple[str, ...]) -> tuple[str, ...]:
    if path.is_file():
        return (str(path),)
    return tuple(sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix in suffixes))


def _require_columns(present: list[str], where: str) -> tuple[str, ...]:
    columns = tuple(c for c in ROW_COLUMNS if c in present)
    if not columns:
        raise DataError(f"{where} has no `messages` or `text` column (columns: {present}); check data.path")
    return columns


def _parquet_columns(file: str) -> tuple[str, ...]:
    import pyarrow.parquet as pq

    return _require_columns(pq.read_schema(file).names, f"data.path file {file!r}")


def load_hf_dataset(path: str) -> Any:
    """`datasets.load_from_disk`; a DatasetDict gives its `train` split (or its only split)."""
    import datasets

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise DataError(
            f"data.path={path!r} is a DatasetDict with splits {list(loaded)} and no `train`; "
            "point data.path at one split's directory"
        )
    return loaded


def _hf_columns(path: str) -> tuple[str, ...]:
    return _require_columns(list(load_hf_dataset(path).column_names), f"data.path={path!r}")


def iter_local_rows(source: DataSource, batch_size: int) -> Iterator[list[dict[str, Any]]]:
    """Row batches without Ray (for `plan`): dicts with `messages`/`text` keys, or `json_line` for JSONL."""
    if source.format == "jsonl":
        yield from _iter_jsonl(source.files, batch_size)
        return
    if source.format == "parquet":
        import pyarrow.parquet as pq

        for file in source.files:
            parquet = pq.ParquetFile(file)
            for batch in parquet.iter_batches(batch_size=batch_size, columns=list(source.columns)):
                yield batch.to_pylist()
        return
    table = load_hf_dataset(source.files[0]).with_format("arrow")[:]  # applies any indices mapping
    for batch in table.select(list(source.columns)).to_batches(max_chunksize=batch_size):
        yield batch.to_pylist()


def _iter_jsonl(files: tuple[str, ...], batch_size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for file in files:
        # Split exactly like ray.data.read_text (str.splitlines, blank lines dropped) so both paths agree.
        for line in Path(file).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            batch.append({"json_line": line})
            if len(batch) == batch_size:
                yield batch
                batch = []
    if batch:
        yield batch
