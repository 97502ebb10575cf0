"""The row-format registry: a RowFormat per `data.format_type` name, and `auto`'s order of preference.

A format module builds one RowFormat and calls `register`; app/data/formats/__init__.py imports every
module once, so the registry is complete whenever `app.data.formats` is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.data.conversation import Conversation


@dataclass(frozen=True)
class RowFormat:
    """One row format: which rows it recognizes (`matches`, on the row's non-null keys) and its adapter.

    `convert` takes the row after data.columns renamed its keys (app/data/formats/columns.py) and returns
    a Conversation whose `format` is `name`, or raises MalformedRow with a short, position-free reason.
    """

    name: str
    matches: Callable[[frozenset[str]], bool]
    convert: Callable[[Mapping[str, Any]], Conversation]


FORMATS: dict[str, RowFormat] = {}
"""Registered formats by data.format_type name."""

AUTO_ORDER = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")
"""`auto` tries the formats in this order and takes the first whose keys the row has: a row with both
`messages` and `text` is a messages row, one with `instruction`, `output` and `text` an alpaca row."""


def register(row_format: RowFormat) -> RowFormat:
    if row_format.name in FORMATS:
        raise ValueError(f"row format {row_format.name!r} is registered twice")
    FORMATS[row_format.name] = row_format
    return row_format
