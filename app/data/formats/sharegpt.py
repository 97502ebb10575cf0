"""`sharegpt` rows: `conversations: [{from, value}]`, with ShareGPT's and LLaMA-Factory's role names.

    {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                       {"from": "function_call",
                        "value": "{\\"name\\": \\"weather\\", \\"arguments\\": {...}}"},
                       {"from": "observation", "value": "18C, sunny"},
                       {"from": "gpt", "value": "18C and sunny."}],
     "system": "You are terse.", "tools": "[{\\"name\\": \\"weather\\", ...}]"}

    from             OpenAI message
    human | user     {"role": "user", "content": value}
    gpt | assistant  {"role": "assistant", "content": value}
    system           {"role": "system", "content": value}
    observation |    {"role": "tool", "content": value}
    tool
    function_call    {"role": "assistant", "content": None, "tool_calls": [...]}: value is a JSON call
                     {"name", "arguments"} or a list of them (LLaMA-Factory's function_call turn)

A turn's keys may also be spelled `role` / `content` (LLaMA-Factory reads OpenAI-style files as ShareGPT
with those tags); data.columns renames others. The optional `system` column becomes a leading system
message unless the conversation starts with a system turn, which then wins, as in LLaMA-Factory's
SharegptDatasetConverter. The optional `tools` list (or a JSON string of it) becomes Conversation.tools.
Each message is then checked as a `messages` message (app/data/formats/messages.py), with reasons that
name `conversations[i]`; a turn's `train: false` / `weight: 0` leaves it out of the loss
(app/data/formats/fields.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from app.data.conversation import Conversation, MalformedRow
from app.data.formats.common import as_list, is_list, present, require_str, tools_of, type_name
from app.data.formats.fields import excluded
from app.data.formats.messages import check_message, empty_conversation
from app.data.formats.registry import RowFormat, register

NAME = "sharegpt"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "observation": "tool", "tool": "tool", "function_call": "assistant"}
"""ShareGPT role (`from`) -> OpenAI role."""
KNOWN = "human, gpt, system, tool, function_call, observation (or user, assistant)"


def convert(record: Mapping[str, Any]) -> Conversation:
    if record.get("conversations") is None:
        raise MalformedRow("no conversations column")
    turns = as_list(record["conversations"], "conversations", "a list of {from, value}")
    messages = [openai_message(f"conversations[{i}]", turn) for i, turn in enumerate(turns)]
    left_out = [i for i, turn in enumerate(turns) if excluded(turn, f"conversations[{i}]")]
    system = "" if record.get("system") is None else require_str(record["system"], "system")
    if system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
        left_out = [i + 1 for i in left_out]
    if not messages:
        return empty_conversation(NAME)
    return Conversation(messages=tuple(messages), tools=tools_of(record), format=NAME,
                        excluded=frozenset(left_out))


def openai_message(where: str, turn: Any) -> dict[str, Any]:
    """One ShareGPT turn as a checked OpenAI message."""
    if not isinstance(turn, Mapping):
        raise MalformedRow(f"{where} is {type_name(turn)}, not a {{from, value}} object")
    fields = present(turn)
    speaker = fields.get("from", fields.get("role"))
    value = fields.get("value", fields.get("content"))
    if speaker is None or value is None:
        raise MalformedRow(f"{where} has no {'from' if speaker is None else 'value'}")
    speaker = require_str(speaker, f"{where}.from")
    if speaker not in ROLES:
        raise MalformedRow(f"{where}.from is {speaker!r}, not one of {KNOWN}")
    if speaker == "function_call":
        message = {"role": "assistant", "tool_calls": function_calls(value, f"{where}.value")}
    elif isinstance(value, str) or is_list(value):  # a list: text parts, joined as messages does
        message = {"role": ROLES[speaker], "content": value}
    else:
        raise MalformedRow(f"{where}.value is {type_name(value)}, not a string")
    return check_message(where, message)


def function_calls(value: Any, where: str) -> list[Any]:
    """A function_call turn's calls: its value (a JSON string, or already an object / a list) as a list."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise MalformedRow(f"{where} is not a JSON function call") from None
    return list(value) if is_list(value) else [value]


register(RowFormat(NAME, lambda keys: "conversations" in keys, convert))
