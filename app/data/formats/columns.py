"""data.columns: read files whose keys or role names differ from a format's (like LLaMA-Factory's
dataset_info `columns` and `tags` in one mapping), as {the name this project reads: the file's name}.

    key group       accepted keys (this project's names)                          renames
    columns         messages conversations instruction input output system         the row's top-level keys
                    history prompt completion text tools
    message keys    role content train weight                                      keys of every message in
                                                                                   messages / conversations /
                                                                                   prompt / completion lists
    role values     user assistant system tool                                     the value of each such
                                                                                   message's role (or from)

    e.g. a ShareGPT file read as `messages`:
        data.columns: {messages: conversations, role: from, content: value, user: human, assistant: gpt}

`system` is in two groups and renames both the top-level system column and the system role value (both
name the system prompt). A mapped key replaces the row's own key of the same name when the row has the
mapped one (non-null); renames within a group happen at once, so {prompt: completion, completion:
prompt} swaps. Any other key, a value that is not a non-empty string, or two names mapped to the same
file name is a DataError naming data.columns, raised when the mapping is first checked (`column_map`,
cached), not once per row.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.data import DataError
from app.data.formats.common import is_list

COLUMN_KEYS = ("messages", "conversations", "instruction", "input", "output", "system", "history", "prompt",
               "completion", "text", "tools")
MESSAGE_KEYS = ("role", "content", "train", "weight")
ROLE_VALUES = ("user", "assistant", "system", "tool")
MESSAGE_LISTS = ("messages", "conversations", "prompt", "completion")
ROLE_KEYS = ("role", "from")
"""Where a message holds its role: OpenAI's `role`, ShareGPT's `from`."""


@dataclass(frozen=True, eq=False)
class ColumnMap:
    """A checked data.columns, each group as {file's name: this project's name}. Hashed by identity
    (column_map returns the same object for the same mapping), so it can sit in a cache key."""

    keys: Mapping[str, str] = field(default_factory=dict)
    message_keys: Mapping[str, str] = field(default_factory=dict)
    roles: Mapping[str, str] = field(default_factory=dict)

    def apply(self, record: Mapping[str, Any]) -> Mapping[str, Any]:
        """The row with its keys, its messages' keys and its role values renamed (itself when no mapping)."""
        if not (self.keys or self.message_keys or self.roles):
            return record
        out = _renamed(record, self.keys)
        if self.message_keys or self.roles:
            for name in MESSAGE_LISTS:
                if is_list(out.get(name)):
                    out[name] = [self._message(message) for message in out[name]]
        return out

    def rename_keys(self, keys: frozenset[str]) -> frozenset[str]:
        """A file's column names as the formats see them (for `detect`)."""
        return frozenset(_renamed(dict.fromkeys(keys, True), self.keys))

    def _message(self, message: Any) -> Any:
        if not isinstance(message, Mapping):
            return message  # the format's adapter says what is wrong with it
        out = _renamed(message, self.message_keys)
        for key in ROLE_KEYS:
            role = out.get(key)
            if isinstance(role, str) and role in self.roles:
                out[key] = self.roles[role]
        return out


def _renamed(record: Mapping[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    """Keys renamed by `renames` (file's -> ours); a present mapped key replaces the row's own."""
    out = {key: value for key, value in record.items() if key not in renames}
    out.update({ours: record[theirs] for theirs, ours in renames.items() if record.get(theirs) is not None})
    return out


NO_MAPPING = ColumnMap()


Columns = Mapping[str, str] | Iterable[tuple[str, str]] | ColumnMap | None
"""data.columns as a dict, as its items (a hashable tuple of pairs, for settings that are cache keys), or
already checked."""


def column_map(columns: Columns) -> ColumnMap:
    """The checked mapping of data.columns; DataError naming data.columns when it is not valid."""
    if columns is None or isinstance(columns, ColumnMap):
        return columns or NO_MAPPING
    items = tuple(columns.items()) if isinstance(columns, Mapping) else tuple(columns)
    if not items:
        return NO_MAPPING
    try:
        return _checked(items)
    except TypeError:  # an unhashable value: report it as _checked would
        return _checked.__wrapped__(items)


@functools.lru_cache(maxsize=16)
def _checked(items: tuple[tuple[str, Any], ...]) -> ColumnMap:
    accepted = (*COLUMN_KEYS, *MESSAGE_KEYS, *ROLE_VALUES)
    for ours, theirs in items:
        if ours not in accepted:
            raise DataError(f"data.columns: unknown key {ours!r}; accepted (this project's names, each "
                            f"mapped to the file's name): {', '.join(dict.fromkeys(accepted))}")
        if not isinstance(theirs, str) or not theirs:
            raise DataError(f"data.columns.{ours} must be the file's key or role name (a non-empty string), "
                            f"not {theirs!r}")
    return ColumnMap(keys=_group(items, COLUMN_KEYS), message_keys=_group(items, MESSAGE_KEYS),
                     roles=_group(items, ROLE_VALUES))


def _group(items: tuple[tuple[str, Any], ...], names: tuple[str, ...]) -> dict[str, str]:
    """{file's name: ours} for the keys of one group; DataError when two of them name the same file name."""
    group: dict[str, str] = {}
    for ours, theirs in items:
        if ours not in names:
            continue
        if theirs in group:
            raise DataError(f"data.columns maps both {group[theirs]!r} and {ours!r} to the file's "
                            f"{theirs!r}; each name of the file can be read as one name only")
        group[theirs] = ours
    return group
