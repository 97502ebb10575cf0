"""The datasets a run reads, resolved on the driver: one per data.sources entry (or the top-level keys).

    data.sources[i] ─ readers.resolve_source ─▶ ResolvedSource: its files, rows as counted before
    (or data.path/hf)                            reading, its template settings (the run's, with its own
                                                 data.format_type / data.columns), its id, and `take`:
                                                 the leading rows the run can use (max_samples; with
                                                 mix_exhausted=stop also what the mix can reach, for any
                                                 seed: scheduling/mix.py rows_needed)

Checks before Ray starts, each one DataError naming the source (`data.sources[i]`, its id) and the key:
its files (the readers' own checks, their messages renamed from data.path to data.sources[i].path), a
source with no rows, a per-message `train` / `weight` field of a type no row can use (parquet and
`datasets` schemas), two sources reading the same file, data.columns reading a `path` column in a mix
(Ray Data's reader writes the file name there), and a source whose first rows the run's chat template
cannot render at all (check_sources_render).

Every row carries its source's id (the `source` column, app/data/ray_ops.py); the stream is the weighted
interleave of the sources (scheduling/mix.py) when data.sources is set, the one source's rows otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.config import DataConfig, SourceConfig
from app.data import DataError
from app.data.formats import check_format_settings, column_map
from app.data.formats.fields import FIELD_MARK, check_field_types
from app.data.readers import PATH_COLUMN, DataSource, iter_local_rows, resolve_source
from app.data.template import TemplateSettings, TokenizedRows, is_template_reason, tokenize_rows
from app.data.tokenizer import TextTokenizer
from scheduling.mix import MixSpec, MixStream, rows_needed
from scheduling.payload import RowStatus

PROBE_ROWS = 16
"""Rows of each source rendered on the driver before Ray starts (check_sources_render)."""
_RENAMED = re.compile(r"\bdata\.(path|format_type|format|columns|split|name|data_files)\b")


@dataclass(frozen=True, eq=False)
class ResolvedSource:
    """One dataset of the run (module docstring)."""

    index: int
    id: str
    config: SourceConfig
    data: DataSource
    settings: TemplateSettings
    take: int | None
    """Rows the pipeline reads from its start (None: all)."""
    key: str
    """How messages name it: data.sources[i] (or data.path for the top-level source)."""

    @property
    def json_lines(self) -> bool:
        return self.data.format == "jsonl"

    def spec(self, tokenizer: str) -> tuple[Any, ...]:
        """What a tokenize task needs of it (hashable: ray_ops caches its tokenizers by it)."""
        return (tokenizer, self.settings, self.json_lines, self.id, tuple(self.data.files))


def mix_spec(data: DataConfig) -> MixSpec | None:
    """data.sources' weights, data.seed and data.mix_exhausted; None without data.sources."""
    if not data.sources:
        return None
    return MixSpec(weights=tuple(s.weight for s in data.sources), seed=data.seed,
                   exhausted=data.mix_exhausted)


def source_data_config(data: DataConfig, entry: SourceConfig) -> DataConfig:
    """The DataConfig that reads one entry with the run's readers (its source keys at the top level)."""
    keys = {key: getattr(entry, key) for key in ("source", "path", "name", "split", "data_files", "format",
                                                 "format_type", "columns")}
    return dataclasses.replace(data, sources=(), **keys)


def renamed_error(err: DataError, index: int, source_id: str) -> DataError:
    """A reader's error about one entry, naming data.sources[index].<key> and its id."""
    message = _RENAMED.sub(lambda m: f"data.sources[{index}].{m.group(1)}", str(err))
    return DataError(f"{message} (source {source_id!r})")


def resolve_sources(data: DataConfig, settings: TemplateSettings) -> tuple[ResolvedSource, ...]:
    """Every dataset the run reads, checked (module docstring); () for synthetic and prepared data."""
    entries = data.source_configs()
    mixed = bool(data.sources)
    resolved = []
    for index, entry in enumerate(entries):
        source_id = entry.source_id
        key = f"data.sources[{index}]" if mixed else "data.path"
        try:
            check_format_settings(entry.format_type, entry.columns)
            source = resolve_source(source_data_config(data, entry))
            check_field_types(source.schema, column_map(entry.columns), key)
        except DataError as err:
            raise (renamed_error(err, index, source_id) if mixed else err) from None
        if source.num_rows == 0:
            raise DataError(f"{key}.path={entry.path!r} holds no rows" + (f" (source {source_id!r})" if mixed
                                                                          else ""))
        if mixed and PATH_COLUMN in column_map(entry.columns).keys:
            raise DataError(f"{key}.columns reads the column {PATH_COLUMN!r}, which a mix of sources uses "
                            f"for each row's file (Ray Data's include_paths): rename it (source "
                            f"{source_id!r})")
        source_settings = dataclasses.replace(settings, format_type=entry.format_type, columns=entry.columns)
        take = entry.max_samples or None
        resolved.append(ResolvedSource(index=index, id=source_id, config=entry, data=source,
                                       settings=source_settings, take=take, key=key))
    _check_distinct_files(resolved)
    spec = mix_spec(data)
    if spec is not None and resolved and all(s.data.num_rows is not None for s in resolved):
        counts = [min(s.data.num_rows, s.take or s.data.num_rows) for s in resolved]
        resolved = [dataclasses.replace(s, take=needed if needed < s.data.num_rows else None)
                    for s, needed in zip(resolved, rows_needed(counts, spec), strict=True)]
    return tuple(resolved)


def _check_distinct_files(sources: list[ResolvedSource]) -> None:
    """A file read by two sources would be one source's rows twice, and its rows could not say whose."""
    owner: dict[str, ResolvedSource] = {}
    for source in sources:
        for file in source.data.files:
            if file in owner:
                raise DataError(f"{owner[file].key} ({owner[file].id!r}) and {source.key} ({source.id!r}) "
                                f"both read {file!r}: a file belongs to one source")
            owner[file] = source


def local_rows(source: ResolvedSource, batch_size: int) -> Iterator[dict[str, Any]]:
    """The source's rows in order without Ray (preview, plan), at most `take`."""
    rows = (row for batch in iter_local_rows(source.data, batch_size) for row in batch)
    return itertools.islice(rows, source.take) if source.take is not None else rows


def check_sources_render(sources: tuple[ResolvedSource, ...], tok: TextTokenizer) -> None:
    """Before Ray starts: each source's first PROBE_ROWS rows are rendered with the run's template; a source
    none of whose probed rows the template can render, or with a per-message field of a type no row can use,
    is a DataError naming it and the key (data.chat_template, or the field)."""
    for source in sources:
        rows = _head_rows(source, PROBE_ROWS)
        out = tokenize_rows(rows, tok, source.settings)
        reasons = [why for why, status in zip(out.reason, out.status, strict=True)
                   if status == RowStatus.MALFORMED]
        field = next((why for why in reasons if FIELD_MARK in why), None)
        if field is not None:
            raise DataError(f"{source.key} ({source.id!r}): {field}")
        if rows and len(reasons) == len(rows) and all(is_template_reason(why) for why in reasons):
            raise DataError(f"{source.key} ({source.id!r}): data.chat_template cannot render its rows "
                            f"({reasons[0]}); its row format ({source.config.format_type}) cannot share the "
                            "run's template: set data.chat_template, or the source's format_type / columns")


def _head_rows(source: ResolvedSource, count: int) -> list[dict[str, Any]]:
    """The first `count` rows of a source without reading all of it: a JSONL file's first lines from its
    first MiBs (a whole file could be many GB), the other formats' first batch."""
    if not source.json_lines:
        return list(itertools.islice(local_rows(source, count), count))
    data, size = source.data, 1 << 20
    while True:
        with (open(data.files[0], "rb") if data.filesystem is None
              else data.filesystem.open_input_stream(data.files[0])) as handle:
            head = handle.read(size)
        complete = len(head) < size
        text = head.decode("utf-8", errors="ignore")
        lines = [line for line in text.splitlines()[: None if complete else -1] if line.strip()]
        if complete or len(lines) >= count:
            return [{"json_line": line} for line in lines[:count]]
        size *= 4


def mixed_local_rows(sources: tuple[ResolvedSource, ...], spec: MixSpec | None,
                     batch_size: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(source index, row) of the run's stream without Ray (preview, plan): the weighted interleave of the
    sources (scheduling/mix.py MixStream, the planner's order), or the one source's rows."""
    if spec is None:
        yield from ((0, row) for row in local_rows(sources[0], batch_size))
        return
    yield from MixStream([functools.partial(local_rows, source, batch_size) for source in sources], spec)


def tokenize_by_source(rows: list[tuple[int, dict[str, Any]]], tok: TextTokenizer,
                       sources: tuple[ResolvedSource, ...]) -> TokenizedRows:
    """tokenize_rows of (source index, row) pairs, each row with its source's settings, in their order."""
    out = TokenizedRows()
    results: list[tuple[Any, ...]] = [()] * len(rows)
    for index, source in enumerate(sources):
        mine = [i for i, (which, _) in enumerate(rows) if which == index]
        if not mine:
            continue
        part = tokenize_rows([rows[i][1] for i in mine], tok, source.settings)
        for j, i in enumerate(mine):
            results[i] = (part.input_ids[j], part.labels[j], part.status[j], part.raw_tokens[j],
                          part.reason[j], part.format[j])
    for ids, labels, status, raw, reason, row_format in results:
        out.input_ids.append(ids)
        out.labels.append(labels)
        out.status.append(status)
        out.raw_tokens.append(raw)
        out.reason.append(reason)
        out.format.append(row_format)
    return out
