"""`text` rows: `{"text": "..."}`, one labeled segment (the template appends EOS when data.add_eos)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.data.conversation import Conversation, MalformedRow
from app.data.formats.common import require_str
from app.data.formats.registry import RowFormat, register

NAME = "text"


def convert(record: Mapping[str, Any]) -> Conversation:
    if record.get("text") is None:
        raise MalformedRow("no text column")
    return Conversation(segments=((require_str(record["text"], "text"), True),), format=NAME)


register(RowFormat(NAME, lambda keys: "text" in keys, convert))
