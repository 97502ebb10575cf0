"""A prepared dataset: the rows `data prepare` tokenized once, read by data.source=prepared as they are.

    DIR/                              (a local directory or an object-store URI)
    ├── part-<hex>.parquet, ...       the tokenized rows (app/data/ray_ops.py TOKENIZED_COLUMNS), one
    │                                 shard per block a tokenize task wrote (app/data/prepare.py)
    └── skrull_prepared.json          the manifest, written last (a reader needs it, so a prepare that
                                      stopped half-way is never read); its shard list is the stream order:
        {"format": "skrull-prepared", "version": 2, "rows": N, "shards": [[name, rows], ...],
         "counts": {status: n}, "formats": {format: n}, "tokens": usable tokens, "label_tokens": ...,
         "sources": {id: rows in the shards},
         "source": {"data.source", "data.path" (redacted), ...; or "data.sources": [each entry's keys];
                    "fingerprint": app/data/fingerprint.py, of each source},
         "identity": {knob: value}}

The shards hold every source's rows (each row's `source` column names its entry), in the order Ray Data's
union handed them on; the planner mixes them by weight as for a tokenizing run (scheduling/mix.py).

`identity` is what the rows depend on, by the config knob that sets it (IDENTITY_KNOBS):

    data.tokenizer       {"name", "sha256"}  the vocabulary and special tokens (tokenizer_identity)
    data.chat_template   {"setting", "sha256"} of the Jinja text the rows were rendered with (null: none)
    data.max_length      the maximum sequence length the rows were cut / dropped at (data.max_length
                         capped by scheduling.bucket_size * parallel.cp_size)
    data.too_long, data.truncate_side, data.labels, data.format_type, data.columns, data.add_eos
    data.sources         each entry's id, weight, max_samples, format_type and columns (where its rows came
                         from is the source record's); [] for one source
    data.mix_exhausted

A run with data.source=prepared computes the same record from its own config (identity_of) and
`check_identity` refuses, before Ray starts, with one DataError naming every knob that differs (the
tokenizer and template by hash: another path to the same tokenizer is the same tokenizer). The run's data
fingerprint (what a resume compares, app/rundir/snapshot.py) is the shards' fingerprint together with the
source fingerprint the manifest recorded, so resuming on a set prepared again from other data is refused.
Nothing here imports Ray: `data preview` and `plan` read the shards with pyarrow (`iter_rows`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.config import DataConfig
from app.data import DataError
from app.data.ray_ops import TOKENIZED_COLUMNS
from app.data.readers import DataSource
from app.data.template import TemplateSettings
from app.data.tokenizer import TextTokenizer, tokenizer_identity
from workers.storage import Location, redact_uri

MANIFEST = "skrull_prepared.json"
FORMAT = "skrull-prepared"
VERSION = 2
IDENTITY_KNOBS = ("data.tokenizer", "data.chat_template", "data.max_length", "data.too_long",
                  "data.truncate_side", "data.labels", "data.format_type", "data.columns", "data.add_eos",
                  "data.sources", "data.mix_exhausted")
SOURCE_IDENTITY = ("id", "weight", "max_samples", "format_type", "columns")
"""What a data.sources entry's rows depend on (and the mix: its weight), for the identity."""
_BY_HASH = ("data.tokenizer", "data.chat_template")
"""Compared by their "sha256" only (the name or setting says where it came from)."""
PREPARE_HINT = "python -m app data prepare --config X --set data.source=path --set data.path=RAW --out DIR"


@dataclass(frozen=True)
class Manifest:
    """A prepared dataset's manifest (see the module docstring) and where it lives."""

    location: Location
    record: dict[str, Any]

    @property
    def shards(self) -> list[tuple[str, int]]:
        return [(str(name), int(rows)) for name, rows in self.record["shards"]]

    @property
    def rows(self) -> int:
        return int(self.record["rows"])

    @property
    def identity(self) -> dict[str, Any]:
        return dict(self.record["identity"])

    @property
    def source(self) -> dict[str, Any]:
        return dict(self.record["source"])

    def data_source(self) -> DataSource:
        """The shards as a DataSource (format "prepared"; files are paths inside `filesystem`)."""
        files = tuple((self.location / name).path for name, _ in self.shards)
        remote = not self.location.is_local
        return DataSource(format="prepared", files=files, columns=TOKENIZED_COLUMNS,
                          filesystem=self.location.filesystem if remote else None)


def identity_of(data: DataConfig, tok: TextTokenizer, settings: TemplateSettings,
                template_text: str | None) -> dict[str, Any]:
    """The identity record (see the module docstring) of rows tokenized with these settings."""
    template = None if template_text is None else hashlib.sha256(template_text.encode()).hexdigest()
    return {
        "data.tokenizer": tokenizer_identity(tok),
        "data.chat_template": {"setting": data.chat_template, "sha256": template},
        "data.max_length": settings.max_length, "data.too_long": data.too_long,
        "data.truncate_side": data.truncate_side, "data.labels": data.labels,
        "data.format_type": data.format_type, "data.columns": dict(sorted(data.columns.items())),
        "data.add_eos": data.add_eos,
        "data.sources": [{"id": entry.source_id, "weight": entry.weight, "max_samples": entry.max_samples,
                          "format_type": entry.format_type, "columns": dict(sorted(entry.columns.items()))}
                         for entry in data.sources],
        "data.mix_exhausted": data.mix_exhausted if data.sources else None,
    }


def source_record(data: DataConfig, fingerprints: dict[str, Any]) -> dict[str, Any]:
    """What the rows were read from, for the manifest: the data.* source keys (data.sources' entries) and
    their fingerprints (ResolvedData.fingerprints: {"data.path": ...} or {"data.sources[i]": ...})."""
    if data.sources:
        entries = [{"id": entry.source_id} | {key: _shown_value(getattr(entry, key)) for key in (
            "source", "path", "name", "split", "data_files", "format")} for entry in data.sources]
        fingerprint = {key: value for key, value in fingerprints.items() if key.startswith("data.sources")}
        return {"data.sources": entries, "fingerprint": fingerprint}
    keys = {"synthetic": ("distribution", "num_samples", "seed", "length_scale"),
            "hf": ("path", "name", "split", "data_files"), "path": ("path", "format")}[data.source]
    record: dict[str, Any] = {"data.source": data.source}
    for key in keys:
        record[f"data.{key}"] = _shown_value(getattr(data, key))
    return record | {"fingerprint": fingerprints["data.path"]}


def _shown_value(value: Any) -> Any:
    return redact_uri(value) if isinstance(value, str) else list(value) if isinstance(value, tuple) else value


def read_manifest(data: DataConfig) -> Manifest:
    """data.path's manifest; DataError naming data.path when it is missing, unreadable or not ours."""
    where = Location.of(data.path)
    shown = redact_uri(data.path)
    try:
        text = (where / MANIFEST).read_text()
    except FileNotFoundError:
        raise DataError(f"data.path={shown!r} is not a prepared dataset (no {MANIFEST} in it): write one "
                        f"with `{PREPARE_HINT}`, or read raw data with data.source=path") from None
    except OSError as err:
        raise DataError(f"data.path={shown!r}: {MANIFEST} cannot be read ({type(err).__name__}: "
                        f"{str(err).splitlines()[0]}); check data.path and its storage") from None
    try:
        record = json.loads(text)
        ok = record.get("format") == FORMAT and isinstance(record.get("shards"), list)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise DataError(f"data.path={shown!r}: {MANIFEST} is not a `data prepare` manifest; prepare the data "
                        f"again (`{PREPARE_HINT}`)")
    if record.get("version") != VERSION:
        raise DataError(f"data.path={shown!r} was prepared by manifest version {record.get('version')}, this "
                        f"version reads {VERSION}; prepare the data again (`{PREPARE_HINT}`)")
    return Manifest(location=where, record=record)


def check_identity(manifest: Manifest, expected: dict[str, Any], data: DataConfig) -> None:
    """One DataError naming every knob whose value differs from the one the set was prepared with."""
    recorded = manifest.identity
    differ = [knob for knob in IDENTITY_KNOBS if _key(knob, recorded.get(knob)) != _key(knob, expected[knob])]
    if not differ:
        return
    parts = [f"{knob}: prepared with {_shown(knob, recorded.get(knob))}, this config has "
             f"{_shown(knob, expected[knob])}{_LIMIT if knob == 'data.max_length' else ''}"
             for knob in differ if knob != "data.sources"]
    if "data.sources" in differ:
        entries = source_differences(recorded.get("data.sources") or [], expected["data.sources"])
        parts.append("; ".join(entries))
        differ = [knob for knob in differ if knob != "data.sources"] + [e.split(":")[0] for e in entries]
    raise DataError(
        f"data.path={redact_uri(data.path)!r} was prepared with other settings than this run's: "
        f"{'; '.join(parts)}. Set {', '.join(differ)} as the set was prepared, or prepare it again with "
        f"this config (`{PREPARE_HINT}`)")


_LIMIT = " (the maximum sequence length: data.max_length capped by scheduling.bucket_size * parallel.cp_size)"


def source_differences(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[str]:
    """`data.sources[i].key: prepared with X, this config has Y` for each entry key that differs (an entry
    added or removed: `data.sources: N entries ... M`)."""
    if len(before) != len(now):
        return [f"data.sources: prepared with {len(before)} entries ({[e.get('id') for e in before]}), this "
                f"config has {len(now)} ({[e.get('id') for e in now]})"]
    return [f"data.sources[{i}].{key}: prepared with {old.get(key)!r}, this config has {new.get(key)!r}"
            for i, (old, new) in enumerate(zip(before, now, strict=True)) for key in SOURCE_IDENTITY
            if old.get(key) != new.get(key)]


def _key(knob: str, value: Any) -> Any:
    return value.get("sha256") if knob in _BY_HASH and isinstance(value, dict) else value


def _shown(knob: str, value: Any) -> str:
    """A value as the error shows it: a tokenizer or template by name and the start of its hash."""
    if knob in _BY_HASH and isinstance(value, dict):
        name = value.get("name", value.get("setting"))
        digest = value.get("sha256")
        return f"{name!r} (sha256 {digest[:12]})" if digest else f"{name!r} (no template)"
    return repr(value)


def iter_rows(source: DataSource, batch_size: int,
              columns: tuple[str, ...] = TOKENIZED_COLUMNS) -> Iterator[list[dict[str, Any]]]:
    """Tokenized rows of the shards in stream order, `batch_size` at a time, without Ray (preview, plan):
    each row a dict of `columns`, ids and labels as lists."""
    import pyarrow.parquet as pq

    for file in source.files:
        parquet = pq.ParquetFile(file, filesystem=source.filesystem)
        for batch in parquet.iter_batches(batch_size=batch_size, columns=list(columns)):
            yield batch.to_pylist()


def prepared_fingerprint(manifest: Manifest, data: DataConfig) -> dict[str, Any]:
    """The run's data fingerprint for a prepared set: its shards' (app/data/fingerprint.py) and the
    fingerprint of the data it was prepared from; DataError naming data.path when a shard is missing."""
    from app.data.fingerprint import data_fingerprint

    try:
        shards = data_fingerprint(data, manifest.data_source())
    except OSError as err:
        raise DataError(f"data.path={redact_uri(data.path)!r}: a shard its {MANIFEST} lists cannot be read "
                        f"({type(err).__name__}: {str(err).splitlines()[0]}); prepare the data again "
                        f"(`{PREPARE_HINT}`)") from None
    return shards | {"prepared_from": manifest.source.get("fingerprint")}
