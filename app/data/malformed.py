"""Malformed rows are loud: count them by reason, keep the first one, stop above data.max_malformed_fraction.

A row no row format can read (app/data/formats/) or the template cannot render (app/data/template.py) has
status `malformed` and a short `reason` ("messages[1].content is a number, not a string", "bad JSON
(Expecting ',' delimiter)", "conversations[2].from is 'bot', not one of ...", ...). The pre-start
scan (app/data/scan.py scan_dataset) and the `plan` dry run (app/data/lengths.py) both fold their rows
into a MalformedTally, show it in the data summary and call `check_malformed`, which raises a DataError
naming the file, the fraction, the most common reason and data.max_malformed_fraction. Nothing here
imports Ray.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from app.config import DataConfig
from app.data import DataError
from scheduling.payload import RowStatus

SHOWN_REASONS = 3
"""The summary line names the most common reasons up to this many, then counts the rest."""


@dataclass
class MalformedTally:
    """Rows read, malformed rows by reason, and the first malformed row's stream position and reason."""

    rows: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    first: tuple[int, str] | None = None

    @property
    def count(self) -> int:
        return sum(self.reasons.values())

    @property
    def fraction(self) -> float:
        """Malformed rows / rows read (0.0 when nothing was read)."""
        return self.count / self.rows if self.rows else 0.0

    def add(self, statuses: Iterable[str], reasons: Iterable[str]) -> None:
        """Fold the next rows of the stream in (positions continue from the rows already added).

        Only the malformed rows are visited in Python. Reasons are kept as plain `str` (numpy batches
        hold np.str_, whose repr would leak into messages).
        """
        status = np.asarray(statuses).astype(str)
        why = np.asarray(reasons, dtype=object)
        if len(why) != len(status):
            raise ValueError(f"{len(status)} statuses but {len(why)} reasons")
        for index in np.flatnonzero(status == RowStatus.MALFORMED):
            reason = str(why[index]) or "unknown reason"
            self.reasons[reason] += 1
            if self.first is None:
                self.first = (self.rows + int(index), reason)
        self.rows += len(status)

    def breakdown(self) -> str:
        """Counts by reason, most common first, then the first malformed row; "" without malformed rows.

            40 'messages[1].content is a number, not a string'; first: row 1
            3 'bad JSON (Expecting value)', 1 'no messages, conversations, ...'; first: row 7, 'bad JSON ...'
        """
        if self.first is None:
            return ""
        common = self.reasons.most_common()
        by_reason = ", ".join(f"{n} {reason!r}" for reason, n in common[:SHOWN_REASONS])
        if len(common) > SHOWN_REASONS:
            others = len(common) - SHOWN_REASONS
            by_reason += f", {sum(n for _, n in common[SHOWN_REASONS:])} with {others} other " \
                         f"reason{'s' if others > 1 else ''}"
        first_index, first_reason = self.first
        first = f"row {first_index}" if len(self.reasons) == 1 else f"row {first_index}, {first_reason!r}"
        return f"{by_reason}; first: {first}"

    def detail(self) -> str:
        """`N malformed (breakdown)`; "" without malformed rows."""
        return f"{self.count} malformed ({self.breakdown()})" if self.first is not None else ""

    @property
    def top_reason(self) -> str:
        return self.reasons.most_common(1)[0][0] if self.reasons else ""

    def as_json(self) -> dict[str, object]:
        """{"count", "by_reason", "first_row", "first_reason"} for JSON documents."""
        first_row, first_reason = self.first if self.first is not None else (None, None)
        return {"count": self.count, "by_reason": dict(self.reasons.most_common()),
                "first_row": first_row, "first_reason": first_reason}


def data_location(data: DataConfig) -> str:
    """What the scanned rows came from, as a config key: data.path='...' or the synthetic source."""
    if data.source == "path":
        return f"data.path={data.path!r}"
    if data.source == "hf":
        return f"data.path={data.path!r} (data.source=hf, data.split={data.split!r})"
    if data.source == "prepared":
        return f"data.path={data.path!r} (data.source=prepared)"
    if data.sources:
        return f"data.sources ({', '.join(entry.source_id for entry in data.sources)})"
    return f"data.source=synthetic (data.num_samples={data.num_samples})"


def check_malformed(data: DataConfig, tally: MalformedTally) -> None:
    """DataError when malformed rows / rows read exceed data.max_malformed_fraction.

    The message names the file, the fraction, the most common reason, the first offending row and the
    knob, e.g. "data.path='chat.jsonl': 40 of 80 rows read (fraction 0.5) are malformed, above
    data.max_malformed_fraction=0.05; ...".
    """
    limit = data.max_malformed_fraction
    if not tally.rows or tally.fraction <= limit:
        return
    top = tally.top_reason
    first_index, first_reason = tally.first or (0, top)
    first = f"{first_index}" if first_reason == top else f"{first_index} ({first_reason!r})"
    raise DataError(
        f"{data_location(data)}: {tally.count} of {tally.rows} rows read (fraction {tally.fraction:.3g}) are "
        f"malformed, above data.max_malformed_fraction={limit}; most common reason: {top!r} "
        f"({tally.reasons[top]} rows), first malformed row: {first}. Fix the file, or tell how to read it: "
        f"data.format_type={data.format_type} (auto|messages|sharegpt|alpaca|prompt_completion|text) and "
        "data.columns (its key and role names)"
        + (", or raise data.max_malformed_fraction to train on the other rows" if tally.count < tally.rows
           else "; no row of it can be read (data.max_malformed_fraction)")
    )
