"""Per-message loss fields of messages / ShareGPT rows: `"train": false` or `"weight": 0` (axolotl's
convention) leaves that message's tokens out of the loss, in every data.labels mode.

    {"role": "assistant", "content": "a bad answer", "train": false}    no loss on it
    {"from": "gpt", "value": "a bad answer", "weight": 0}                no loss on it
    "train": true / "weight": 1 / absent / null                          as data.labels says

`train` must be a boolean and `weight` 0 or 1: any other value is a malformed row whose reason names the
field and says "per-message" (FIELD_MARK), which the data scan turns into one error naming the source and the
field (app/data/scan.py) instead of a count, since a typo there would silently change what trains. Where a
file's schema is known before reading its rows (parquet, `datasets`), a field of a type no row can use is
that error before Ray starts (check_field_types). data.columns may rename them (message keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from app.data import DataError
from app.data.conversation import MalformedRow
from app.data.formats.common import type_name

MESSAGE_FIELDS = ("train", "weight")
FIELD_MARK = "per-message"
"""In the reason of every malformed row this module makes (app/data/scan.py finds them by it)."""


def excluded(message: Mapping[str, Any], where: str) -> bool:
    """Whether the message's `train` / `weight` field leaves it out of the loss; MalformedRow for a value
    that is neither (module docstring)."""
    train, weight = message.get("train"), message.get("weight")
    if train is not None and not isinstance(train, bool | np.bool_):
        raise MalformedRow(f"{where}.train is {type_name(train)}, not true or false (a {FIELD_MARK} train "
                           "field: false leaves the message out of the loss)")
    if weight is not None and (isinstance(weight, bool | np.bool_) or not isinstance(
            weight, int | float | np.integer | np.floating) or weight not in (0, 1)):
        numeric = isinstance(weight, int | float | np.integer | np.floating)
        shown = repr(weight) if numeric else type_name(weight)
        raise MalformedRow(f"{where}.weight is {shown}, not 0 or 1 (a {FIELD_MARK} weight: 0 leaves the "
                           "message out of the loss)")
    return (train is not None and not train) or (weight is not None and weight == 0)


def check_field_types(schema: Any, columns: Any, key: str) -> None:
    """DataError naming `key` and the field when a list-of-messages column of an Arrow schema holds a
    `train` field that is not boolean or a `weight` field that is not a number (columns: ColumnMap)."""
    import pyarrow as pa

    if schema is None:
        return
    for column in schema:
        item = column.type.value_type if pa.types.is_list(column.type) or pa.types.is_large_list(
            column.type) else None
        if item is None or not pa.types.is_struct(item):
            continue
        for field in item:
            name = columns.message_keys.get(field.name, field.name)
            if name == "train" and not (pa.types.is_boolean(field.type) or pa.types.is_null(field.type)):
                raise DataError(f"{key}: {column.name}[].{field.name} is {field.type} in the file's schema; "
                                f"a {FIELD_MARK} train field must be true or false")
            numeric = pa.types.is_integer(field.type) or pa.types.is_floating(field.type)
            if name == "weight" and not (numeric or pa.types.is_null(field.type)):
                raise DataError(f"{key}: {column.name}[].{field.name} is {field.type} in the file's schema; "
                                f"a {FIELD_MARK} weight must be 0 or 1")
