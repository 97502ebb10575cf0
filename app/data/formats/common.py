"""Checks shared by the row-format adapters; every failure is a MalformedRow with a short reason.

Reasons name the field ("messages[1].content") and what is wrong with it, never the row's position, so a
scan can count rows by reason (app/data/malformed.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from app.data.conversation import MalformedRow


def type_name(value: Any) -> str:
    """A JSON-ish name of a value's type for reasons: a list, a number, null, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (Sequence, np.ndarray)):
        return "a list"
    return f"a {type(value).__name__}"


def is_list(value: Any) -> bool:
    """A JSON array: a list/tuple, or the object array Ray's numpy batches hold lists as (not a string)."""
    return isinstance(value, (list, tuple, np.ndarray)) and not isinstance(value, str)


def as_list(value: Any, where: str, expected: str) -> list[Any]:
    """`value` as a Python list; MalformedRow "{where} is {type}, not {expected}" otherwise."""
    if not is_list(value):
        raise MalformedRow(f"{where} is {type_name(value)}, not {expected}")
    return list(value)


def require_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise MalformedRow(f"{where} is {type_name(value)}, not a string")
    return value


def present(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record without null values: a missing key and a null one are the same (parquet and Arrow
    struct columns fill every absent field with null)."""
    return {key: value for key, value in record.items() if value is not None}


def tools_of(record: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """The optional top-level `tools` list (function schemas) as a tuple of dicts; () when absent.

    A JSON string holding the list is accepted too, and so is a bare function schema {name, description,
    parameters}, which becomes {"type": "function", "function": schema}, the form transformers' chat
    templates document (LLaMA-Factory's ShareGPT files store bare schemas as a JSON string).
    """
    tools = record.get("tools")
    if tools is None:
        return ()
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise MalformedRow("tools is a string that is not a JSON list") from None
    items = as_list(tools, "tools", "a list of tool objects")
    for index, tool in enumerate(items):
        if not isinstance(tool, Mapping):
            raise MalformedRow(f"tools[{index}] is {type_name(tool)}, not an object")
    return tuple(_wrapped(drop_nulls(tool)) for tool in items)


def _wrapped(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": tool} if "type" not in tool and "name" in tool else tool


def drop_nulls(value: Any) -> Any:
    """A JSON value with every null-valued object key removed, lists as lists (deeply).

    Arrow struct columns give every row every field of the file's union schema, null where a row has
    none; a template would render `"description": null` for a field the row never had.
    """
    if isinstance(value, Mapping):
        return {key: drop_nulls(item) for key, item in value.items() if item is not None}
    if is_list(value):
        return [drop_nulls(item) for item in value]
    return value
