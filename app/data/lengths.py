"""Token lengths of a run's dataset without Ray, for the `plan` dry run.

    data.source=path | hf  read rows locally (pyarrow / datasets / JSONL lines), tokenize them with the same
                           template code Ray Data runs, and keep the lengths of usable rows
    data.source=synthetic  the synthetic targets (the generator hits them exactly: see app/data/synth.py),
                           raised to the shortest conversation the template allows

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


def scan_local(data: DataConfig, limit: int | None = None) -> LocalScan:
    """dataset_token_lengths with what the rows read were: by format, malformed by reason.

    The synthetic source is all `messages` rows and never malformed.
    """
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
