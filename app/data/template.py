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

Label tokens are counted as the loss sees them: it predicts token t+1 from token t (targets = labels
shifted left by one, workers/batch.py shifted_targets), so the first token's label is never a target and
a row's label tokens are count(labels[1:] != -100) (scheduling.payload.Sample.num_label_tokens).

Length limit (max_length) with data.too_long=truncate cuts a window of max_length tokens out of the row,
from the side data.truncate_side names. The 18-token row above with max_length=8 (S = <|im_start|>,
E = <|im_end|>, _ = a space):

    ids    S user \\n What _is _ 2 + 2 ? E \\n S assistant \\n 4 E \\n
    left   (default) keep the LAST 8:  E \\n S assistant \\n 4 E \\n
           labels -100 -100 -100 -100 -100 4 E -100: 2 label tokens after the shift      -> truncated
    right  keep the FIRST 8:           S user \\n What _is _ 2 +
           no label token                                                                -> truncated_empty

Left keeps the end of the conversation, so on long-context / short-answer data (a long user context, a
short answer last) the last answer survives whole whenever it fits; right keeps the start (the old rule).

Status of a row (never raised: the consumer counts and skips), decided in this order:
    malformed        wrong types, bad JSON; `reason` says what, in a few words that do not depend on the
                     row's position (so a scan can count rows by reason, app/data/malformed.py):
                     "messages[1].content is a list, not a string", "no messages or text column", ...
    empty            no label token after the shift before any limit (no tokens, a one-token row, a chat
                     without an assistant turn with data.labels=assistant)
    ok               fits in max_length
    truncated        too long, data.too_long=truncate, and the window keeps >= 1 label token
    truncated_empty  too long, data.too_long=truncate, and the window keeps no label token
    dropped / too_long   too long with data.too_long = drop / error
Every row that is not malformed has reason "". Only ok and truncated rows are usable
(scheduling.payload.USABLE_STATUSES): each has >= 1 label token after truncation and the shift. Every
other row carries empty ids and labels; `raw_tokens` keeps the length before truncation/dropping and
`label_tokens` the label tokens of the ids the row carries.
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
_TRUNCATE_SIDES = ("left", "right")


class MalformedRow(Exception):
    """Internal: this row cannot be rendered; reported with status `malformed` and str(err) as its reason."""


def _type_name(value: Any) -> str:
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


@dataclass(frozen=True)
class TemplateSettings:
    """How rows become tokens: data.chat_template, data.labels, max length, data.too_long, data.truncate_side.

    truncate_side (with too_long=truncate): "left" keeps the LAST max_length tokens (drops the oldest
    context, so the last answer survives), "right" keeps the FIRST max_length.
    """

    chat_template: bool = True
    labels: str = "assistant"
    max_length: int | None = None
    too_long: str = "error"
    truncate_side: str = "left"

    def __post_init__(self) -> None:
        if self.labels not in ("assistant", "all"):
            raise ValueError(f"data.labels={self.labels!r} is not one of: assistant, all")
        if self.too_long not in _TOO_LONG_STATUS:
            raise ValueError(f"data.too_long={self.too_long!r} is not one of: error, truncate, drop")
        if self.truncate_side not in _TRUNCATE_SIDES:
            raise ValueError(f"data.truncate_side={self.truncate_side!r} is not one of: left, right")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length={self.max_length} must be >= 1 (data.max_length, "
                             "scheduling.bucket_size * parallel.cp_size)")


@dataclass
class TokenizedRows:
    """Column lists for a batch of rows; `input_ids[i]` and `labels[i]` are int32 arrays."""

    input_ids: list[np.ndarray] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    status: list[str] = field(default_factory=list)
    raw_tokens: list[int] = field(default_factory=list)
    reason: list[str] = field(default_factory=list)
    """Why each malformed row could not be rendered ("" for every other row)."""

    @property
    def num_tokens(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]

    @property
    def label_tokens(self) -> list[int]:
        """Label tokens of each row's ids after the shift (0 for every row that is not usable)."""
        return [count_label_tokens(labels) for labels in self.labels]


def count_label_tokens(labels: np.ndarray) -> int:
    """Tokens that are a next-token target: count(labels[1:] != -100), as the loss sees them.

    Same rule as scheduling.payload.Sample.num_label_tokens: the loss's targets are the labels shifted
    left by one, so the first token's label never counts (a one-token row has no target at all).
    """
    return int(np.count_nonzero(labels[1:] != IGNORE_INDEX))


# A rendered row before encoding: (special-token id | text to encode, whether it carries labels).
Piece = tuple[int | str, bool]


def parse_record(row: Mapping[str, Any]) -> tuple[str, Any]:
    """('messages', list) or ('text', str) from a row with `messages`, `text` or a raw `json_line`."""
    if row.get("json_line") is not None:
        try:
            row = json.loads(row["json_line"])
        except json.JSONDecodeError as err:
            raise MalformedRow(f"bad JSON ({err.msg})") from None
        except TypeError:
            raise MalformedRow("bad JSON (not a text line)") from None
        if not isinstance(row, dict):
            raise MalformedRow(f"a JSON line must be an object, not {_type_name(row)}")
    if row.get("messages") is not None:
        return "messages", row["messages"]
    if row.get("text") is not None:
        return "text", row["text"]
    raise MalformedRow("no messages or text column")


def render_pieces(kind: str, value: Any, tok: TextTokenizer, settings: TemplateSettings) -> list[Piece]:
    """Lay out one row as special ids and text pieces, each text marked with whether it carries labels."""
    label_all = settings.labels == "all"
    if kind == "text":
        if not isinstance(value, str):
            raise MalformedRow(f"text is {_type_name(value)}, not a string")
        return [(value, True)] if value else []
    if isinstance(value, np.ndarray):  # Ray's numpy batches hold lists as object arrays
        value = list(value)
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise MalformedRow(f"messages is {_type_name(value)}, not a list of {{role, content}}")
    pieces: list[Piece] = []
    for index, message in enumerate(value):
        role, content = _check_message(index, message)
        labeled = label_all or role == "assistant"
        if not settings.chat_template:
            pieces.append((content, labeled))
            continue
        im_start, im_end = tok.require_chat_ids()
        pieces += [(im_start, label_all), (f"{role}\n", label_all), (content, labeled),
                   (im_end, labeled), ("\n", label_all)]
    return pieces


def _check_message(index: int, message: Any) -> tuple[str, str]:
    """(role, content) of messages[index]; MalformedRow naming the message and the field otherwise."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise MalformedRow(f"{where} is {_type_name(message)}, not a {{role, content}} object")
    role, content = message.get("role"), message.get("content")
    if role is None or content is None:
        missing = "role" if role is None else "content"
        raise MalformedRow(f"{where} has no {missing}")
    if not isinstance(role, str):
        raise MalformedRow(f"{where}.role is {_type_name(role)}, not a string")
    if not role or "\n" in role:
        raise MalformedRow(f"{where}.role is empty or holds a newline")
    if not isinstance(content, str):
        raise MalformedRow(f"{where}.content is {_type_name(content)}, not a string")
    return role, content


def _assemble(pieces: list[Piece], encoded: dict[str, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate pieces into (ids, labels) using the batch's encodings of the text pieces."""
    ids: list[int] = []
    labels: list[int] = []
    for value, labeled in pieces:
        part = [value] if isinstance(value, int) else encoded[value]
        ids += part
        labels += part if labeled else [IGNORE_INDEX] * len(part)
    return np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)


def _apply_limit(ids: np.ndarray, labels: np.ndarray,
                 settings: TemplateSettings) -> tuple[np.ndarray, np.ndarray, str]:
    """(ids, labels, status) after the empty-row check, the length limit and the post-truncation check.

    1. no label token after the shift in the whole row -> empty
    2. len <= max_length (or no limit) -> ok, unchanged
    3. too long: drop / error -> dropped / too_long; truncate -> the window of max_length tokens at the
       data.truncate_side end, then truncated if it keeps >= 1 label token after the shift, else
       truncated_empty. Counting after the cut AND the shift is what makes "usable" mean "trains on
       something": checking before either one let truncation or a one-token row produce a 0.0 loss.
    Rows that are not ok / truncated come back with empty ids and labels.
    """
    if count_label_tokens(labels) == 0:
        return ids[:0], labels[:0], "empty"
    limit = settings.max_length
    if limit is None or len(ids) <= limit:
        return ids, labels, "ok"
    status = _TOO_LONG_STATUS[settings.too_long]
    if status != "truncated":
        return ids[:0], labels[:0], status
    window = slice(len(ids) - limit, None) if settings.truncate_side == "left" else slice(0, limit)
    ids, labels = ids[window], labels[window]
    if count_label_tokens(labels) == 0:
        return ids[:0], labels[:0], "truncated_empty"
    return ids, labels, status


def tokenize_rows(rows: Sequence[Mapping[str, Any]], tok: TextTokenizer,
                  settings: TemplateSettings) -> TokenizedRows:
    """Tokenize a batch of rows; all texts of the batch go to the tokenizer in one `encode_batch` call."""
    rendered: list[list[Piece] | str] = []
    texts: dict[str, None] = {}
    for row in rows:
        try:
            pieces = render_pieces(*parse_record(row), tok, settings)
        except MalformedRow as err:
            rendered.append(str(err))
            continue
        rendered.append(pieces)
        texts.update((value, None) for value, _ in pieces if isinstance(value, str))
    unique = list(texts)
    encoded = dict(zip(unique, tok.encode_batch(unique), strict=True))
    out = TokenizedRows()
    empty = np.zeros(0, dtype=np.int32)
    for pieces in rendered:
        reason = pieces if isinstance(pieces, str) else ""
        if isinstance(pieces, str):
            ids, labels, status, raw = empty, empty, "malformed", 0
        else:
            full_ids, full_labels = _assemble(pieces, encoded)
            ids, labels, status = _apply_limit(full_ids, full_labels, settings)
            raw = len(full_ids)
        out.input_ids.append(ids)
        out.labels.append(labels)
        out.status.append(status)
        out.raw_tokens.append(raw)
        out.reason.append(reason)
    return out
