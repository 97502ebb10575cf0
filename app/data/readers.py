"""Dataset sources: detection, ordered file lists, the row-format check, and Ray-free row batches.

    data.source  data.format  data.path                          rows
    path         parquet      file.parquet | dir of *.parquet     every column of the files
    path         jsonl        file.jsonl | dir of *.jsonl         a JSON object per line (blank ones skipped)
    path         hf           `datasets` save_to_disk directory  every column of the dataset
    path         auto         hf if the dir holds dataset_info.json / state.json / dataset_dict.json,
                              else by suffix
    hf           (ignored)    hub dataset id | local dataset dir  every column of `load_dataset(...)` (hub.py)

Rows keep every column: which ones matter is the row format's business (app/data/formats/, data.format_type,
data.columns). Where the schema is known before reading a row (parquet, save_to_disk, load_dataset) the
columns must match at least one registered format (`formats.detect`, after the data.columns mapping), or
resolve_source fails with one DataError naming data.path, the columns, data.format_type and data.columns;
JSONL rows are checked one by one as they are tokenized (a row no format reads is a counted `malformed` row).

Files of a directory are read in sorted path order (nested dirs included), so the row stream, and with it
the planner's sample ids, is the same on every run. JSONL lines are handed on raw (`json_line`) and parsed
by the tokenizer, so one bad line is a counted `malformed` row instead of a failed read.

Bad files fail on the driver, in resolve_source, with one DataError naming data.path and the file, before
any Ray task starts: every parquet file's schema (footer) is read, so a 0-byte, cut-off or non-parquet
file, or one that cannot be opened, is caught there; every JSONL file is read through once and decoded as
UTF-8 (a line-at-a-time reader would otherwise die mid-run with a raw UnicodeDecodeError). A `datasets`
source (save_to_disk or load_dataset) is loaded there too, once per process, and rides on the DataSource
(`dataset`) to `plan` and to the Ray pipeline.

data.path may also be a URI of a pyarrow filesystem (s3://bucket/data.parquet?endpoint_override=..., see
workers/storage.py): the same checks run through that filesystem, `files` are paths inside it and
`filesystem` goes to Ray Data's readers. The `hf` format needs a local (or mounted) directory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.config import DataConfig
from app.data import DataError, formats
from app.data.hub import describe, load_split
from workers.storage import Location, is_remote, redact_text

LOAD_DATASET = "load_dataset"
"""DataSource.format of data.source=hf (app/data/hub.py)."""
PATH_COLUMN = "path"
"""The file of each row, as Ray Data's readers write it with include_paths: how a mix's tokenize map tells
its rows' sources apart (app/data/ray_ops.py SourcesTokenizer)."""
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclass(frozen=True)
class DataSource:
    """A resolved dataset: its format, its files in read order and its columns.

    files: parquet / jsonl: the data files; hf: the save_to_disk directory; load_dataset: the Arrow files
    of the split in the datasets cache (what the run's fingerprint hashes). columns: every column, in
    schema order; () for JSONL, whose keys are only known row by row.
    """

    format: str
    files: tuple[str, ...]
    columns: tuple[str, ...]
    filesystem: Any = None
    """The pyarrow filesystem `files` are in (data.path a URI), or None: local files."""
    dataset: Any = field(default=None, compare=False, repr=False)
    """hf / load_dataset: the loaded `datasets.Dataset` (loaded once, read by `plan` and the pipeline)."""
    num_rows: int | None = None
    """Rows it holds, as known before reading them: exact for parquet (footers) and `datasets`, for JSONL
    its lines (blank ones included: an upper bound); None: not counted."""
    schema: Any = field(default=None, compare=False, repr=False)
    """The Arrow schema of its rows (parquet: the first file's; `datasets`: its table's); None for JSONL."""


def resolve_source(data: DataConfig) -> DataSource:
    """Check data.path, detect data.format, list files in order; DataError naming the knob on failure.

    The messages carry no secret of a URI's query (pyarrow's own error text repeats the URI it failed on).
    """
    try:
        return _resolve_source(data)
    except DataError as err:
        raise DataError(redact_text(str(err), data.path)) from None


def _resolve_source(data: DataConfig) -> DataSource:
    if data.source == "hf":
        return _resolve_load_dataset(data)
    if not data.path:
        raise DataError("data.source=path needs data.path (a parquet, jsonl or HF dataset directory)")
    if is_remote(data.path):
        return _resolve_remote(data)
    path = Path(data.path).expanduser()
    if not path.exists():
        raise DataError(f"data.path={data.path!r} does not exist (looked at {path.resolve()})")
    fmt = data.format if data.format != "auto" else _detect_format(path)
    if fmt == "hf":
        if not path.is_dir():
            raise DataError(f"data.format=hf needs a save_to_disk directory; data.path={data.path!r}")
        dataset = load_hf_dataset(str(path))
        columns = _require_format(data, dataset.column_names, f"data.path={data.path!r}")
        return DataSource(format="hf", files=(str(path),), columns=columns, dataset=dataset,
                          num_rows=len(dataset), schema=dataset.data.schema)
    suffix = ".parquet" if fmt == "parquet" else ".jsonl"
    files = _list_files(path, (suffix, ".json") if fmt == "jsonl" else (suffix,))
    if not files:
        raise DataError(f"data.path={data.path!r} holds no {suffix} files (data.format={data.format})")
    if fmt == "jsonl":
        lines = sum(_check_utf8(file) for file in files)
        return DataSource(format=fmt, files=files, columns=(), num_rows=lines)
    return _parquet_source(data, files)


def _resolve_load_dataset(data: DataConfig) -> DataSource:
    """data.source=hf: load the split (hub.py), check its columns, list its Arrow files in the cache."""
    dataset = load_split(data)
    columns = _require_format(data, dataset.column_names, describe(data))
    files = tuple(entry["filename"] for entry in dataset.cache_files)
    return DataSource(format=LOAD_DATASET, files=files, columns=columns, dataset=dataset,
                      num_rows=len(dataset), schema=dataset.data.schema)


def _resolve_remote(data: DataConfig) -> DataSource:
    """resolve_source for a URI: the object (or every object below the prefix) through its filesystem."""
    if data.format == "hf":
        raise _remote_hf(data.path)
    try:
        where = Location.of(data.path)
        files = [where] if where.is_file() else where.files()
    except (OSError, ValueError) as err:
        raise DataError(f"data.path={data.path!r} cannot be reached ({str(err).splitlines()[0]}); check the "
                        "URI, the endpoint (endpoint_override= in the URI or AWS_ENDPOINT_URL) and the "
                        "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)") from None
    if not files:
        raise DataError(f"data.path={data.path!r} does not exist (no object at or below it)")
    names = [f.name for f in files]
    fmt = data.format
    if fmt == "auto":
        fmt = "hf" if any(n in _HF_MARKERS for n in names) else _detect_format(Path(where.name), names=names)
    if fmt == "hf":
        raise _remote_hf(data.path)
    suffixes = (".parquet",) if fmt == "parquet" else (".jsonl", ".json")
    paths = tuple(f.path for f in files if Path(f.name).suffix in suffixes)
    if not paths:
        raise DataError(f"data.path={data.path!r} holds no {suffixes[0]} files (data.format={data.format})")
    filesystem = where.filesystem
    if fmt == "jsonl":
        lines = sum(_check_utf8(file, filesystem) for file in paths)
        return DataSource(format=fmt, files=paths, columns=(), filesystem=filesystem, num_rows=lines)
    return _parquet_source(data, paths, filesystem)


def _remote_hf(path: str) -> DataError:
    return DataError(f"data.format=hf reads a local save_to_disk directory; data.path={path!r} is a URI: "
                     "copy the dataset to a local/mounted directory, or store it as parquet or jsonl")


def _detect_format(path: Path, *, names: list[str] | None = None) -> str:
    if names is not None:  # a remote prefix: the names of the objects below it
        found = [_SUFFIXES[s] for s in {Path(n).suffix for n in names} if s in _SUFFIXES]
    elif path.is_dir():
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


def _parquet_source(data: DataConfig, files: tuple[str, ...], filesystem: Any = None) -> DataSource:
    """Every file's footer is read (bad files fail here) and its columns checked; the DataSource with the
    first file's columns and schema and the files' rows."""
    footers = [_parquet_footer(file, filesystem) for file in files]
    for file, (schema, _) in zip(files, footers, strict=True):
        _require_format(data, schema.names, f"data.path file {file!r}")
    schema = footers[0][0]
    return DataSource(format="parquet", files=files, columns=tuple(schema.names), filesystem=filesystem,
                      num_rows=sum(rows for _, rows in footers), schema=schema)


def _require_format(data: DataConfig, present: Sequence[str], where: str) -> tuple[str, ...]:
    """`present` as a tuple when a row format reads rows with these columns, else DataError.

    The format is data.format_type, or with `auto` any registered one (`formats.detect`), after the
    data.columns renames. Whether each row is well-formed is decided row by row when it is tokenized.
    """
    columns = tuple(present)
    if _readable_as(data, frozenset(columns)) is None:
        which = "no row format reads" if data.format_type == "auto" else \
            f"row format {data.format_type!r} does not read"
        raise DataError(
            f"{where} has columns {list(columns)}, which {which} (data.format_type="
            f"{data.format_type}, data.columns={dict(data.columns)}; formats: {', '.join(formats.FORMATS)}); "
            "map the columns with data.columns (e.g. {prompt: question, completion: answer}), set "
            "data.format_type, or check data.path"
        )
    return columns


def _readable_as(data: DataConfig, keys: frozenset[str]) -> str | None:
    """The format rows with these column names are read as: data.format_type, or the one `auto` picks.

    None when that format (with `auto`: every registered one) cannot read rows with these keys.
    """
    if data.format_type == "auto":
        return formats.detect(keys, data.columns)
    row_format = formats.FORMATS[formats.check_format(data.format_type)]
    return row_format.name if row_format.matches(formats.column_map(data.columns).rename_keys(keys)) else None


def _unreadable(file: str, why: object) -> DataError:
    return DataError(f"data.path file {file!r} cannot be read: {why}; fix or remove the file, or point "
                     "data.path elsewhere")


def _parquet_footer(file: str, filesystem: Any = None) -> tuple[Any, int]:
    """(Arrow schema, rows) from the file's footer; DataError for an empty, cut-off or non-parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        size = filesystem.get_file_info(file).size if filesystem is not None else Path(file).stat().st_size
        footer = pq.read_metadata(file, filesystem=filesystem) if size else None
        schema = footer.schema.to_arrow_schema() if footer is not None else None
    except (OSError, ValueError, pa.ArrowException) as err:  # ArrowInvalid is a ValueError, IO errors OSError
        raise _unreadable(file, f"not a valid parquet file ({type(err).__name__}: {err})") from None
    if footer is None:  # pyarrow's own message for this case does not say which file
        raise _unreadable(file, "it is empty (0 bytes), not a parquet file")
    return schema, footer.num_rows


_UTF8_CHUNK = 16 << 20  # bytes decoded at a time: bounded memory on any file size


def _check_utf8(file: str, filesystem: Any = None) -> int:
    """Decode the whole file as UTF-8 in chunks; its lines (blank ones included); DataError naming the file
    and the first bad line."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0  # bytes and newlines of the chunks already decoded, to place an error
    last_newline = True
    try:
        with open(file, "rb") if filesystem is None else filesystem.open_input_stream(file) as handle:
            while chunk := handle.read(_UTF8_CHUNK):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    # err.start is relative to the chunk plus any bytes the decoder held back from the
                    # previous one (< 4); clamp so the position stays inside this chunk.
                    start = max(0, min(err.start, len(chunk)))
                    line = lines + chunk.count(b"\n", 0, start) + 1
                    raise _unreadable(file, f"line {line} (near byte {offset + start}) is not valid UTF-8 "
                                            f"({err.reason})") from None
                offset += len(chunk)
                lines += chunk.count(b"\n")
                last_newline = chunk.endswith(b"\n")
            decoder.decode(b"", final=True)
            return lines + (1 if offset and not last_newline else 0)
    except UnicodeDecodeError as err:  # the file ends inside a multi-byte character
        raise _unreadable(file, f"it ends inside a UTF-8 character ({err.reason})") from None
    except OSError as err:
        raise _unreadable(file, f"{type(err).__name__}: {err}") from None


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


def arrow_table(source: DataSource) -> Any:
    """The pyarrow Table of an hf / load_dataset source, in row order (any indices mapping applied)."""
    return source.dataset.with_format("arrow")[:]


def iter_local_rows(source: DataSource, batch_size: int) -> Iterator[list[dict[str, Any]]]:
    """Row batches without Ray (for `plan`): dicts of every column, or {`json_line`: line} for JSONL."""
    if source.format == "jsonl":
        yield from _iter_jsonl(source.files, batch_size, source.filesystem)
        return
    if source.format == "parquet":
        import pyarrow.parquet as pq

        for file in source.files:
            parquet = pq.ParquetFile(file, filesystem=source.filesystem)
            for batch in parquet.iter_batches(batch_size=batch_size):
                yield batch.to_pylist()
        return
    for batch in arrow_table(source).to_batches(max_chunksize=batch_size):
        yield batch.to_pylist()


def _iter_jsonl(files: tuple[str, ...], batch_size: int,
                filesystem: Any = None) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for file in files:
        if filesystem is None:
            text = Path(file).read_text(encoding="utf-8")
        else:
            with filesystem.open_input_stream(file) as stream:
                text = stream.read().decode("utf-8")
        # Split exactly like ray.data.read_text (str.splitlines, blank lines dropped) so both paths agree.
        for line in text.splitlines():
            if not line.strip():
                continue
            batch.append({"json_line": line})
            if len(batch) == batch_size:
                yield batch
                batch = []
    if batch:
        yield batch
