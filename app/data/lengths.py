"""Token lengths of a run's dataset without Ray, for the `plan` dry run.

    data.source=path | hf  read rows locally (pyarrow / datasets / JSONL lines), tokenize them with the same
    data.sources           template code Ray Data runs, and keep the lengths of usable rows (a mix: its
                           stream, the weighted interleave the planner trains in: scheduling/mix.py)
    data.source=synthetic  the synthetic targets (the generator hits them exactly: see app/data/synth.py),
                           raised to the shortest conversation the template allows
    data.source=prepared   the shards' num_tokens and status columns (app/data/prepared.py), after the
                           manifest is checked against the config (`max_length` is then required)

No length limit is applied: the caller compares the lengths with SkrullConfig.max_sequence_length itself.
Malformed rows are counted by reason and rows by row format (what data.format_type=auto chose) over the
rows read; above data.max_malformed_fraction `plan` stops with the same DataError as the pre-start scan of
`train` (app/data/malformed.py). `LocalScan.as_json()` is the data section of `plan --json`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from app.config import DataConfig
from app.data.formats import check_format_settings, count_formats
from app.data.malformed import MalformedTally, check_malformed
from app.data.resolved import template_settings
from app.data.sources import mix_spec, mixed_local_rows, resolve_sources, tokenize_by_source
from app.data.synth import ConversationSynth, target_lengths
from app.data.tokenizer import load_tokenizer
from scheduling.payload import RowStatus


@dataclass(frozen=True, eq=False)
class LocalScan:
    """The rows `plan` read: usable lengths (stream order), malformed rows by reason, rows by format."""

    lengths: np.ndarray
    malformed: MalformedTally = field(default_factory=MalformedTally)
    formats: dict[str, int] = field(default_factory=dict)
    sources: dict[str, dict[str, float]] = field(default_factory=dict)
    """With data.sources: {id: {"rows", "tokens", "share"}} over the rows read (tokens of usable rows)."""

    def as_json(self) -> dict[str, object]:
        """{"rows", "usable_rows", "formats": {name: count}, "malformed": {...}} for `plan --json`, and
        "sources" with data.sources."""
        return {"rows": self.malformed.rows, "usable_rows": len(self.lengths), "formats": dict(self.formats),
                "malformed": self.malformed.as_json()} | ({"sources": self.sources} if self.sources else {})


def dataset_token_lengths(data: DataConfig, limit: int | None = None) -> np.ndarray:
    """Token counts (int64, stream order) of the first `limit` rows (all when None) that are usable.

    Empty and malformed rows are skipped, as the training stream skips them; `limit` counts rows read.
    DataError (app/data/malformed.py) when the malformed rows read exceed data.max_malformed_fraction.
    """
    return scan_local(data, limit).lengths


def scan_local(data: DataConfig, limit: int | None = None, max_length: int | None = None) -> LocalScan:
    """dataset_token_lengths with what the rows read were: by format, malformed by reason.

    The synthetic source is all `messages` rows and never malformed. max_length: the run's maximum
    sequence length (only a prepared set needs it: its manifest must match).
    """
    if data.source == "prepared":
        return _scan_prepared(data, limit, max_length)
    tok = load_tokenizer(data.tokenizer)
    if data.synthetic:
        num = data.num_samples if limit is None else min(limit, data.num_samples)
        targets = target_lengths(data.distribution, data.num_samples, data.seed, data.length_scale)[:num]
        tally = MalformedTally(rows=num)
        return LocalScan(np.maximum(targets, ConversationSynth(tok).min_length()), tally, {"messages": num})
    check_format_settings(data.format_type, data.columns)
    settings = template_settings(data, None)  # the run's template settings, without a length limit
    sources = resolve_sources(data, settings)
    lengths: list[int] = []
    malformed = MalformedTally()
    formats: Counter[str] = Counter()
    tally = SourceTally([source.id for source in sources])
    stream = mixed_local_rows(sources, mix_spec(data), data.tokenize_batch_size)
    while chunk := list(itertools.islice(stream, _chunk(data, limit, malformed.rows))):
        out = tokenize_by_source(chunk, tok, sources)
        malformed.add(out.status, out.reason)
        count_formats(formats, out.format)
        ok = [status == RowStatus.OK for status in out.status]
        lengths += [n for n, good in zip(out.num_tokens, ok, strict=True) if good]
        tally.add([which for which, _ in chunk], out.num_tokens, ok)
    check_malformed(data, malformed)
    return LocalScan(np.asarray(lengths, dtype=np.int64), malformed, dict(formats.most_common()),
                     tally.stats() if data.sources else {})


def _chunk(data: DataConfig, limit: int | None, read: int) -> int:
    """Rows to read next: a tokenize batch, at most what `limit` leaves."""
    return data.tokenize_batch_size if limit is None else min(data.tokenize_batch_size, limit - read)


class SourceTally:
    """Rows and usable tokens by source over rows read in stream order: the mix `plan` and `data preview`
    show ({id: {"rows", "tokens", "share"}})."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.rows = [0] * len(ids)
        self.tokens = [0] * len(ids)

    def add(self, sources: list[int], tokens: list[int], usable: list[bool]) -> None:
        for which, count, good in zip(sources, tokens, usable, strict=True):
            self.rows[which] += 1
            self.tokens[which] += count if good else 0

    def stats(self) -> dict[str, dict[str, float]]:
        total = max(sum(self.rows), 1)
        return {name: {"rows": rows, "tokens": tokens, "share": round(rows / total, 4)}
                for name, rows, tokens in zip(self.ids, self.rows, self.tokens, strict=True)}


def _scan_prepared(data: DataConfig, limit: int | None, max_length: int | None) -> LocalScan:
    """scan_local of a prepared set: its rows' statuses and lengths as `data prepare` wrote them (already
    cut to max_length: truncated rows count as usable, as the run's stream has them), in the stream's
    order (with data.sources: the weighted interleave of the sources' rows, scheduling/mix.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.resolved import resolve_data
    from scheduling.mix import stream_rows
    from scheduling.payload import USABLE_STATUSES

    if max_length is None:
        raise ValueError("a prepared set is checked against the run's maximum sequence length: max_length")
    source = resolve_data(data, max_length=max_length).source
    columns = ["num_tokens", "status", "reason", "format", "source"]
    table = pa.concat_tables([pq.read_table(file, columns=columns, filesystem=source.filesystem)
                              for file in source.files])
    rows = {name: table.column(name).to_numpy(zero_copy_only=False) for name in columns}
    spec = mix_spec(data)
    if spec is not None:
        names, codes = np.unique(rows["source"].astype(str), return_inverse=True)
        ids = tuple(entry.source_id for entry in data.sources)
        order = stream_rows(codes, [str(n) for n in names], ids, spec).table_rows
    else:
        order = np.arange(table.num_rows)
    order = order[:limit] if limit is not None else order
    status = rows["status"][order].astype(str)
    malformed = MalformedTally()
    malformed.add(status, rows["reason"][order])
    formats: Counter[str] = Counter()
    count_formats(formats, rows["format"][order].astype(str))
    usable = np.isin(status, USABLE_STATUSES)
    lengths = rows["num_tokens"][order][usable].astype(np.int64)
    tally = SourceTally([entry.source_id for entry in data.sources])
    if data.sources:
        index = {entry.source_id: i for i, entry in enumerate(data.sources)}
        tally.add([index[str(name)] for name in rows["source"][order]],
                  rows["num_tokens"][order].tolist(), usable.tolist())
    check_malformed(data, malformed)
    return LocalScan(lengths, malformed, dict(formats.most_common()), tally.stats() if data.sources else {})
