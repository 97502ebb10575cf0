"""Row formats: each turns one raw row into a Conversation (app/data/conversation.py), registered by name.

    data.format_type    row keys (after data.columns renamed them)                       module
    messages            messages: [{role, content, tool_calls?, tool_call_id?}], tools?  messages.py
    sharegpt            conversations: [{from, value}], system?, tools?                  sharegpt.py
    alpaca              instruction, input?, output, system?, history?                   alpaca.py
    prompt_completion   prompt, completion (both strings, or both lists of messages)     prompt_completion.py
    text                text                                                             text.py

`to_conversation(row, format_type, columns)` is the one entry point per row: a JSONL row arrives as its
raw line (`json_line`) and is parsed here, so a bad line is a counted malformed row; data.columns
(columns.py) renames its keys; then the format converts it. `auto` decides per row: the first format of
registry.AUTO_ORDER (messages, conversations, instruction+output, prompt+completion, text) whose keys the
row has (non-null). `detect(keys, columns)` makes the same choice from a file's column names, so a reader
can check a file before Ray starts. A new format is one module with a RowFormat and one `register` call,
imported below and named in AUTO_ORDER.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from app.data import DataError
from app.data.conversation import Conversation, MalformedRow
from app.data.formats import alpaca, messages, prompt_completion, sharegpt, text  # noqa: F401  (register)
from app.data.formats.columns import ColumnMap, Columns, column_map
from app.data.formats.common import type_name
from app.data.formats.registry import AUTO_ORDER, FORMATS, RowFormat, register

NO_FORMAT = "no messages, conversations, instruction/output, prompt/completion or text column"
"""The reason of a row whose keys match no format (data.format_type=auto)."""

__all__ = ["AUTO_ORDER", "FORMATS", "NO_FORMAT", "ColumnMap", "Columns", "RowFormat", "check_format",
           "check_format_settings", "column_map", "count_formats", "describe_formats", "detect",
           "parse_json_line", "register", "to_conversation"]


def parse_json_line(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row itself, or the object a raw JSONL line (`json_line`) holds; MalformedRow for bad JSON."""
    if row.get("json_line") is None:
        return row
    try:
        parsed = json.loads(row["json_line"])
    except json.JSONDecodeError as err:
        raise MalformedRow(f"bad JSON ({err.msg})") from None
    except TypeError:
        raise MalformedRow("bad JSON (not a text line)") from None
    if not isinstance(parsed, dict):
        raise MalformedRow(f"a JSON line must be an object, not {type_name(parsed)}")
    return parsed


def count_formats(counts: Counter[str], formats: Iterable[str]) -> None:
    """Add a batch's `format` column to counts; "" (a row no format read: bad JSON, no known column) is
    not counted, since it is a malformed row and the malformed count says so."""
    counts.update(str(name) for name in formats if name)


def describe_formats(counts: Mapping[str, int]) -> str:
    """`formats: sharegpt=318, alpaca=2` (most rows first) for the data summary; "" when every row counted
    is a `messages` row (the synthetic source, and a plain chat file, whose line stays as it was)."""
    if not counts or set(counts) == {"messages"}:
        return ""
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return "formats: " + ", ".join(f"{name}={n}" for name, n in ordered)


def check_format(format_type: str) -> str:
    """format_type itself when it is `auto` or registered; DataError naming data.format_type otherwise."""
    if format_type != "auto" and format_type not in FORMATS:
        raise DataError(f"data.format_type={format_type!r} is not one of: auto, {', '.join(FORMATS)}")
    return format_type


def check_format_settings(format_type: str, columns: Columns) -> ColumnMap:
    """data.format_type and data.columns checked once, on the driver, before any row is read: DataError
    naming the knob, instead of the same error from every batch inside a Ray task."""
    check_format(format_type)
    return column_map(columns)


def detect(keys: Iterable[str], columns: Columns = None) -> str | None:
    """The format `auto` picks for rows with these keys (after data.columns); None when none fits."""
    present = column_map(columns).rename_keys(frozenset(keys))
    return next((name for name in AUTO_ORDER if name in FORMATS and FORMATS[name].matches(present)), None)


def to_conversation(row: Mapping[str, Any], format_type: str = "auto",
                    columns: Columns = None) -> Conversation:
    """One raw row -> Conversation; MalformedRow (a short reason) when it cannot be read.

    DataError (not per row) for an unknown format_type or an invalid data.columns.
    """
    mapping = column_map(columns)
    record = mapping.apply(parse_json_line(row))
    name = check_format(format_type)
    if name == "auto":
        name = detect(k for k, v in record.items() if v is not None) or ""
        if not name:
            raise MalformedRow(NO_FORMAT)
    return FORMATS[name].convert(record)
