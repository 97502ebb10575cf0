"""Rows -> token ids + labels with the Qwen chat template; pure (no Ray), shared by Ray Data and `plan`.

Chat rows (`messages: [{role, content}, ...]`) render as Qwen's ChatML, one block per message:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

    ids     [im_start] [user \\n] [What is 2+2?] [im_end] [\\n] [im_start] [assistant \\n] [4] [im_end] [\\n]
    labels   -100      -100 -100  -100 ... -100   -100     -100  -100       -100      -100    4   im_end  -100
                                                                                          ^^^^^^^^^^^
    data.labels=assistant: labels = ids on the assistant content and its <|im_end|> only (what the model must
    produce to answer and stop); data.labels=all: labels = ids everywhere. Labels are the HF convention:
    same length as input_ids, unshifted, -100 = no loss.

Each piece is encoded separately ("{role}\\n", the content, "\\n"); this equals encoding the whole rendered
string except when a content starts with whitespace that BPE would merge with the header's newline, and it
makes the label spans exact token boundaries. `text` rows are plain text with labels on every token.

Status of a row (never raised: the consumer counts and skips):
    ok | empty (no tokens or no label tokens) | malformed (wrong types, bad JSON) |
    truncated / dropped / too_long (longer than max_length with data.too_long = truncate / drop / error).
Rows that are not ok or truncated carry empty ids; `raw_tokens` keeps the length before truncation/dropping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.data.tokenizer import TextTokenizer
from scheduling.payload import IGNORE_INDEX

_TOO_LONG_STATUS = {"truncate": "truncated", "drop": "dropped", "error": "too_long"}


class MalformedRow(Exception):
    """Internal: this row cannot be rendered; it is reported with status `malformed`."""


@dataclass(frozen=True)
class TemplateSettings:
    """How rows become tokens: data.chat_template, data.labels, max length and data.too_long."""

    chat_template: bool = True
    labels: str = "assistant"
    max_length: int | None = None
    too_long: str = "error"

    def __post_init__(self) -> None:
        if self.labels not in ("assistant", "all"):
            raise ValueError(f"data.labels={self.labels!r} is not one of: assistant, all")
        if self.too_long not in _TOO_LONG_STATUS:
            raise ValueError(f"data.too_long={self.too_long!r} is not one of: error, truncate, drop")


@dataclass
class TokenizedRows:
    """Column lists for a batch of rows; `input_ids[i]` and `labels[i]` are int32 arrays."""

    input_ids: list[np.ndarray] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    status: list[str] = field(default_factory=list)
    raw_tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]


# A rendered row before encoding: (special-token id | text to encode, whether it carries labels).
Piece = tuple[int | str, bool]


def parse_record(row: Mapping[str, Any]) -> tuple[str, Any]:
    """('messages', list) or ('text', str) from a row with `messages`, `text` or a raw `json_line`."""
    if row.get("json_line") is not None:
        try:
            row = json.loads(row["json_line"])
        except (json.JSONDecodeError, TypeError) as err:
            raise MalformedRow(f"invalid JSON: {err}") from None
        if not isinstance(row, dict):
            raise MalformedRow("a JSON line must be an object")
    if row.get("messages") is not None:
        return "messages", row["messages"]
    if row.get("text") is not None:
        return "text", row["text"]
    raise MalformedRow("row has neither `messages` nor `text`")


def render_pieces(kind: str, value: Any, tok: TextTokenizer, settings: TemplateSettings) -> list[Piece]:
    """Lay out one row as special ids and text pieces, each text marked with whether it carries labels."""
    label_all = settings.labels == "all"
    if kind == "text":
        if not isinstance(value, str):
            raise MalformedRow("`text` must be a string")
        return [(value, True)] if value else []
    if isinstance(value, np.ndarray):  # Ray's numpy batches hold lists as object arrays
        value = list(value)
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise MalformedRow("`messages` must be a list of {role, content}")
    pieces: list[Piece] = []
    for message in value:
        if not isinstance(message, Mapping):
            raise MalformedRow("each message must be a {role, content} mapping")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role or "\n" in role or not isinstance(content, str):
            raise MalformedRow("each message needs a non-empty `role` string and a `content` string")
        labeled = label_all or role == "assistant"
        if not settings.chat_template:
            pieces.append((content, labeled))
            continue
        im_start, im_end = tok.require_chat_ids()
        pieces += [(im_start, label_all), (f"{role}\n", label_all), (content, labeled),
                   (im_end, labeled), ("\n", label_all)]
    return pieces


def _assemble(pieces: list[Piece], encoded: dict[str, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate pieces into (ids, labels) using the batch's encodings of the text pieces."""
    ids: list[int] = []
    labels: list[int] = []
    for value, labeled in pieces:
        part = [value] if isinstance(value, int) else encoded[value]
        ids += part
        labels += part if labeled else [IGNORE_INDEX] * len(part)
    return np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)


def _apply_limit(ids: np.ndarray, labels: np.ndarray, settings: TemplateSettings):
    """(ids, labels, status) after the length limit and the empty-row check."""
    if len(ids) == 0 or not np.any(labels != IGNORE_INDEX):
        return ids[:0], labels[:0], "empty"
    if settings.max_length is None or len(ids) <= settings.max_length:
        return ids, labels, "ok"
    status = _TOO_LONG_STATUS[settings.too_long]
    if status == "truncated":
        return ids[: settings.max_length], labels[: settings.max_length], status
    return ids[:0], labels[:0], status


def tokenize_rows(rows: Sequence[Mapping[str, Any]], tok: TextTokenizer,
                  settings: TemplateSettings) -> TokenizedRows:
    """Tokenize a batch of rows; all texts of the batch go to the tokenizer in one `encode_batch` call."""
    rendered: list[list[Piece] | None] = []
    texts: dict[str, None] = {}
    for row in rows:
        try:
            pieces = render_pieces(*parse_record(row), tok, settings)
        except MalformedRow:
            rendered.append(None)
            continue
        rendered.append(pieces)
        texts.update((value, None) for value, _ in pieces if isinstance(value, str))
    unique = list(texts)
    encoded = dict(zip(unique, tok.encode_batch(unique), strict=True))
    out = TokenizedRows()
    empty = np.zeros(0, dtype=np.int32)
    for pieces in rendered:
        if pieces is None:
            ids, labels, status, raw = empty, empty, "malformed", 0
        else:
            full_ids, full_labels = _assemble(pieces, encoded)
            ids, labels, status = _apply_limit(full_ids, full_labels, settings)
            raw = len(full_ids)
        out.input_ids.append(ids)
        out.labels.append(labels)
        out.status.append(status)
        out.raw_tokens.append(raw)
    return out
