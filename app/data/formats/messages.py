"""`messages` rows: OpenAI chat messages, tool calls included, as transformers' chat templates take them.

    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                  {"role": "assistant", "content": null,
                   "tool_calls": [{"type": "function", "id": "c1", "function": {
                       "name": "weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
                  {"role": "assistant", "content": "18C and sunny."}],
     "tools": [{"type": "function", "function": {"name": "weather", "parameters": {...}}}]}

Each message keeps role, content, and tool_calls / tool_call_id / name when present (other keys are
dropped; `train: false` / `weight: 0` leave the message out of the loss: app/data/formats/fields.py).
Content is a string, or a list of parts of which only `{"type": "text", "text": ...}` is
accepted; the parts are joined with "\\n", as vLLM's OpenAI server joins a text-only message's parts. An
assistant message with tool_calls may have no content (it stays None). Each tool call becomes
`{"type": "function", "id"?, "function": {"name", "arguments": dict}}`: arguments given as a JSON string
(OpenAI's wire form) are parsed, because templates write them with `| tojson` and a string would be
quoted twice. A call given flat (`{"name", "arguments"}`) is accepted too. Roles are free strings
(templates know roles such as `ipython` or `developer`), non-empty and without a newline.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from app.data.conversation import Conversation, MalformedRow
from app.data.formats.common import as_list, is_list, present, require_str, tools_of, type_name
from app.data.formats.fields import excluded
from app.data.formats.registry import RowFormat, register

NAME = "messages"
PARTS_SEPARATOR = "\n"


def convert(record: Mapping[str, Any]) -> Conversation:
    if record.get("messages") is None:
        raise MalformedRow("no messages column")
    return conversation_of(record["messages"], tools_of(record), NAME)


def conversation_of(value: Any, tools: tuple[dict[str, Any], ...], format_name: str,
                    where: str = "messages") -> Conversation:
    """A chat Conversation from a `messages`-style list (also used by the prompt-completion format)."""
    messages, excluded_messages = checked_messages(value, where)
    if not messages:
        return empty_conversation(format_name)
    return Conversation(messages=tuple(messages), tools=tools, format=format_name, excluded=excluded_messages)


def checked_messages(value: Any, where: str) -> tuple[list[dict[str, Any]], frozenset[int]]:
    """(A list of messages, each checked; the indices of those a per-message `train` / `weight` field leaves
    out of the loss); reasons name `{where}[i]`."""
    items = as_list(value, where, "a list of {role, content}")
    messages = [check_message(f"{where}[{i}]", m) for i, m in enumerate(items)]
    return messages, frozenset(i for i, m in enumerate(items) if isinstance(m, Mapping)
                               and excluded(m, f"{where}[{i}]"))


def empty_conversation(format_name: str) -> Conversation:
    """A row with nothing to render. Conversation needs one non-empty field, so it is one empty,
    unlabeled text segment: no tokens (or EOS alone), which the template reports as status `empty`."""
    return Conversation(segments=(("", False),), format=format_name)


def check_message(where: str, message: Any) -> dict[str, Any]:
    """messages[i] as a clean message dict; MalformedRow naming the message and the field otherwise."""
    if not isinstance(message, Mapping):
        raise MalformedRow(f"{where} is {type_name(message)}, not a {{role, content}} object")
    fields = present(message)
    role, content = fields.get("role"), fields.get("content")
    calls = fields.get("tool_calls")
    if is_list(calls) and len(calls) == 0:
        calls = None  # Arrow list columns give a message without calls an empty list
    if role is None:
        raise MalformedRow(f"{where} has no role")
    if content is None and not (role == "assistant" and calls is not None):
        raise MalformedRow(f"{where} has no content")
    role = require_str(role, f"{where}.role")
    if not role or "\n" in role:
        raise MalformedRow(f"{where}.role is empty or holds a newline")
    clean: dict[str, Any] = {"role": role, "content": None if content is None else text_of(content, where)}
    if calls is not None:
        clean["tool_calls"] = tool_calls_of(calls, f"{where}.tool_calls")
    for key in ("tool_call_id", "name"):
        if key in fields:
            clean[key] = require_str(fields[key], f"{where}.{key}")
    return clean


def text_of(content: Any, where: str) -> str:
    """A message's content as one string: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not is_list(content):
        raise MalformedRow(f"{where}.content is {type_name(content)}, not a string")
    texts = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, Mapping):
            raise MalformedRow(f"{at} is {type_name(part)}, not a {{type, text}} part")
        kind = part.get("type")
        if kind != "text":
            shown = repr(kind) if isinstance(kind, str) else type_name(kind)
            raise MalformedRow(f"{at} has type {shown}, not 'text' (only text parts can be trained on)")
        texts.append(require_str(part.get("text"), f"{at}.text"))
    return PARTS_SEPARATOR.join(texts)


def tool_calls_of(value: Any, where: str) -> list[dict[str, Any]]:
    return [tool_call_of(call, f"{where}[{i}]") for i, call in enumerate(as_list(value, where, "a list"))]


def tool_call_of(call: Any, where: str) -> dict[str, Any]:
    """One call as {"type": "function", "id"?, "function": {"name", "arguments": dict}}."""
    if not isinstance(call, Mapping):
        raise MalformedRow(f"{where} is {type_name(call)}, not an object")
    function = call.get("function") if call.get("function") is not None else call
    if not isinstance(function, Mapping):
        raise MalformedRow(f"{where}.function is {type_name(function)}, not an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedRow(f"{where} has no function name")
    clean: dict[str, Any] = {"type": "function",
                             "function": {"name": name, "arguments": arguments_of(function.get("arguments"),
                                                                                  where)}}
    if call.get("id") is not None:
        clean["id"] = require_str(call["id"], f"{where}.id")
    return clean


def arguments_of(arguments: Any, where: str) -> dict[str, Any]:
    """The call's arguments as a dict: {} when absent, a JSON object string parsed."""
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise MalformedRow(f"{where}.function.arguments is not a JSON object") from None
    if not isinstance(arguments, Mapping):
        raise MalformedRow(f"{where}.function.arguments is {type_name(arguments)}, not an object")
    return dict(arguments)


register(RowFormat(NAME, lambda keys: "messages" in keys, convert))
