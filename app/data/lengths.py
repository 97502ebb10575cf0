"""Token lengths of a run's dataset without Ray, for the `plan` dry run.

    data.source=path | hf  read rows locally (pyarrow / datasets / JSONL lines), tokenize them with the same
                           template code Ray Data runs, and keep the lengths of usable rows
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

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from app.config import DataConfig
from app.data.formats import check_format_settings, count_formats
from app.data.malformed import MalformedTally, check_malformed
from app.data.readers import iter_local_rows, resolve_source
from app.data.resolved import template_settings
from app.data.synth import ConversationSynth, target_lengths
from app.data.template import tokenize_rows
from app.data.tokenizer import load_tokenizer
from scheduling.payload import RowStatus


@dataclass(frozen=True, eq=False)
class LocalScan:
    """The rows `plan` read: usable lengths (stream order), malformed rows by reason, rows by format."""

    lengths: np.ndarray
    malformed: MalformedTally = field(default_factory=MalformedTally)
    formats: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        """{"rows", "usable_rows", "formats": {name: count}, "malformed": {...}} for `plan --json`."""
        return {"rows": self.malformed.rows, "usable_rows": len(self.lengths), "formats": dict(self.formats),
                "malformed": self.malformed.as_json()}


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
    if data.source == "synthetic":
        num = data.num_samples if limit is None else min(limit, data.num_samples)
        targets = target_lengths(data.distribution, data.num_samples, data.seed, data.length_scale)[:num]
        tally = MalformedTally(rows=num)
        return LocalScan(np.maximum(targets, ConversationSynth(tok).min_length()), tally, {"messages": num})
    check_format_settings(data.format_type, data.columns)
    settings = template_settings(data, None)  # the run's template settings, without a length limit
    lengths: list[int] = []
    malformed = MalformedTally()
    formats: Counter[str] = Counter()
    remaining = limit
    for rows in iter_local_rows(resolve_source(data), data.tokenize_batch_size):
        if remaining is not None:
            rows = rows[:remaining]
            remaining -= len(rows)
        out = tokenize_rows(rows, tok, settings)
        malformed.add(out.status, out.reason)
        count_formats(formats, out.format)
        lengths += [n for n, status in zip(out.num_tokens, out.status, strict=True) if status == RowStatus.OK]
        if remaining == 0:
            break
    check_malformed(data, malformed)
    return LocalScan(np.asarray(lengths, dtype=np.int64), malformed, dict(formats.most_common()))


def _scan_prepared(data: DataConfig, limit: int | None, max_length: int | None) -> LocalScan:
    """scan_local of a prepared set: its rows' statuses and lengths as `data prepare` wrote them (already
    cut to max_length: truncated rows count as usable, as the run's stream has them)."""
    from app.data.prepared import iter_rows
    from app.data.resolved import resolve_data
    from scheduling.payload import USABLE_STATUSES

    if max_length is None:
        raise ValueError("a prepared set is checked against the run's maximum sequence length: max_length")
    source = resolve_data(data, max_length=max_length).source
    lengths: list[int] = []
    malformed = MalformedTally()
    formats: Counter[str] = Counter()
    columns = ("num_tokens", "status", "reason", "format")
    for rows in iter_rows(source, data.tokenize_batch_size, columns):
        rows = rows if limit is None else rows[: limit - malformed.rows]
        malformed.add([r["status"] for r in rows], [r["reason"] for r in rows])
        count_formats(formats, [r["format"] for r in rows])
        lengths += [r["num_tokens"] for r in rows if r["status"] in USABLE_STATUSES]
        if limit is not None and malformed.rows >= limit:
            break
    check_malformed(data, malformed)
    return LocalScan(np.asarray(lengths, dtype=np.int64), malformed, dict(formats.most_common()))
