"""`alpaca` rows: instruction / input / output, with an optional `system` and `history` of earlier turns.

    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour",
     "system": "You are a translator.", "history": [["Hi", "Hello! How can I help?"]]}
    -> [{"role": "system", "content": "You are a translator."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Translate to French.\\nGood morning"},
        {"role": "assistant", "content": "Bonjour"}]

The user turn is the non-empty ones of instruction and input joined with "\\n" (instruction alone when
input is empty or absent), and every history pair [user, assistant] comes before it: the convention of
LLaMA-Factory's AlpacaDatasetConverter, which renders the turns with the model's own chat template, not
the Stanford Alpaca "Below is an instruction..." prompt. Loss on every assistant turn (history included),
as LLaMA-Factory does unless it masks history.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.data.conversation import Conversation, MalformedRow
from app.data.formats.common import as_list, require_str
from app.data.formats.registry import RowFormat, register

NAME = "alpaca"


def convert(record: Mapping[str, Any]) -> Conversation:
    for key in ("instruction", "output"):
        if record.get(key) is None:
            raise MalformedRow(f"no {key} column")
    texts = {key: optional_str(record, key) for key in ("system", "instruction", "input", "output")}
    messages = [{"role": "system", "content": texts["system"]}] if texts["system"] else []
    messages += history_messages(record.get("history"))
    prompt = "\n".join(text for text in (texts["instruction"], texts["input"]) if text)
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": texts["output"]}]
    return Conversation(messages=tuple(messages), format=NAME)


def optional_str(record: Mapping[str, Any], key: str) -> str:
    """record[key] as a string, "" when absent."""
    return "" if record.get(key) is None else require_str(record[key], key)


def history_messages(history: Any) -> list[dict[str, str]]:
    """[[user, assistant], ...] as alternating user / assistant messages; [] when absent."""
    if history is None:
        return []
    messages = []
    for index, pair in enumerate(as_list(history, "history", "a list of [user, assistant] pairs")):
        where = f"history[{index}]"
        turn = as_list(pair, where, "a [user, assistant] pair")
        if len(turn) != 2:
            raise MalformedRow(f"{where} has {len(turn)} items, not a [user, assistant] pair")
        messages += [{"role": "user", "content": require_str(turn[0], f"{where}[0]")},
                     {"role": "assistant", "content": require_str(turn[1], f"{where}[1]")}]
    return messages


register(RowFormat(NAME, lambda keys: {"instruction", "output"} <= keys, convert))
