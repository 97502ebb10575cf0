"""Rows -> token ids + labels through the run's chat template; pure (no Ray), shared by Ray Data and `plan`.

Every row becomes a Conversation (app/data/formats/: data.format_type, data.columns), then

    chat                    rendered by data.chat_template through transformers, labels on the spans of
                            app/data/chat_template.py, encoded by app/data/chat_encode.py (the whole
                            rendered string, as apply_chat_template encodes it)
    segments                (`text` rows, string prompt-completion rows) each segment encoded as plain text,
                            labeled by its flag, then the tokenizer's EOS with a label (data.add_eos)
    chat, data.chat_template=none
                            one exchange as plain text segments: "{system}\\n{user}\\n" without a loss,
                            "{answer}" with one, then EOS; any other chat (several turns, tool calls) is
                            malformed

With the bundled `qwen` tokenizer the template is ChatML, one block per message:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

    ids     [im_start] [user \\n] [What is 2+2?] [im_end] [\\n] [im_start] [assistant \\n] [4] [im_end] [\\n]
    labels   -100      -100 -100  -100 ... -100   -100     -100  -100       -100      -100    4   im_end  -100
                                                                                          ^^^^^^^^^^^
    data.labels=assistant: labels = ids on the assistant content and its end-of-turn token only (what the
    model must produce to answer and stop), for the assistant turns at index >= Conversation.loss_from;
    data.labels=last_turn: the same on the final such turn only; data.labels=all: labels = ids everywhere.
    In every mode a message with `train: false` / `weight: 0` (app/data/formats/fields.py) carries none (with
    all: none of the characters it adds to the rendering). Labels are the HF convention: same length as
    input_ids, unshifted, -100 = no loss.

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
short answer last) the last answer survives whole whenever it fits; right keeps the start (for data whose
long part is the answer).

Status of a row (never raised: the consumer counts and skips), decided in this order:
    malformed        the row format cannot read it, or the template cannot render it; `reason` says what,
                     in a few words that do not depend on the row's position (so a scan can count rows by
                     reason, app/data/malformed.py): "messages[1].content is a number, not a string",
                     "data.chat_template does not render tool calls (...)", ...
    empty            no label token after the shift before any limit (no tokens, a one-token row, a chat
                     without an assistant turn with data.labels=assistant)
    excluded         no label token because per-message train / weight fields left out every message the
                     label rule would train
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.data import DataError
from app.data.chat_encode import Span, encode_chats
from app.data.chat_template import chat_spans, resolve_template
from app.data.conversation import Conversation, MalformedRow
from app.data.formats import column_map, to_conversation
from app.data.tokenizer import TextTokenizer
from scheduling.payload import IGNORE_INDEX, RowStatus

__all__ = ["MalformedRow", "TemplateSettings", "TokenizedRows", "count_label_tokens", "render",
           "tokenize_rows"]

_TOO_LONG_STATUS = {"truncate": RowStatus.TRUNCATED, "drop": RowStatus.DROPPED, "error": RowStatus.TOO_LONG}
LABEL_MODES = ("assistant", "all", "last_turn")
_TRUNCATE_SIDES = ("left", "right")
NONE_TEMPLATE_REASON = ("data.chat_template=none renders one user -> assistant exchange (an optional system "
                        "message first), not this chat; use a chat template for multi-turn and tool chats")


@dataclass(frozen=True)
class TemplateSettings:
    """How rows become tokens: the data.* knobs of the template, the labels and the length limit.

    chat_template: data.chat_template (auto | model | chatml | none | a Jinja file's path); template_text:
    that file's text, read on the driver (app/data/resolved.py template_settings): workers need no copy.
    columns: data.columns as sorted (key, value) pairs (hashable: settings key the workers' caches).
    truncate_side (with too_long=truncate): "left" keeps the LAST max_length tokens (drops the oldest
    context, so the last answer survives), "right" keeps the FIRST max_length.
    """

    chat_template: str = "auto"
    labels: str = "assistant"
    max_length: int | None = None
    too_long: str = "error"
    truncate_side: str = "left"
    format_type: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()
    add_eos: bool = True
    template_text: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.columns, Mapping):
            object.__setattr__(self, "columns", tuple(sorted(self.columns.items())))
        if not isinstance(self.chat_template, str) or not self.chat_template:
            raise ValueError(f"data.chat_template={self.chat_template!r} must be auto, model, chatml, none "
                             "or a Jinja template file")
        if self.labels not in LABEL_MODES:
            raise ValueError(f"data.labels={self.labels!r} is not one of: {', '.join(LABEL_MODES)}")
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
    format: list[str] = field(default_factory=list)
    """The row format that read each row (Conversation.format; "" for a malformed row)."""

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


@dataclass(frozen=True)
class _Chat:
    """A rendered chat and its loss-bearing character spans."""

    text: str
    spans: list[Span]
    excluded: bool = False
    """Per-message fields took away a message the label rule would train: no label is `excluded`."""


@dataclass(frozen=True)
class _Segments:
    """Plain-text segments (text, carries a loss), then EOS with a label when `eos`."""

    parts: tuple[tuple[str, bool], ...]
    eos: bool
    exact: bool = False
    """The parts' flags already follow data.labels (data.chat_template=none): `all` adds nothing."""


_Layout = _Chat | _Segments | str  # str: the reason of a malformed row


def _layout(conversation: Conversation, tok: TextTokenizer, settings: TemplateSettings) -> _Chat | _Segments:
    """What one conversation renders to before encoding; MalformedRow when it cannot be rendered."""
    if not conversation.is_chat:
        return _Segments(conversation.segments, settings.add_eos)
    template = resolve_template(tok, settings.chat_template, settings.template_text)
    if template.text is None:
        return _plain_exchange(conversation, settings.labels)
    return _Chat(*chat_spans(template, tok, conversation, settings.labels),
                 excluded=conversation.excludes_a_trained_message(settings.labels))


def _plain_exchange(conversation: Conversation, labels: str) -> _Segments:
    """data.chat_template=none: (system?) user -> assistant as "{system}\\n{user}\\n" + answer, then EOS; with
    labels=all the prompt carries a loss too, in every mode an excluded message none."""
    messages = conversation.messages
    roles = [m.get("role") for m in messages]
    if roles not in (["user", "assistant"], ["system", "user", "assistant"]) or any(
            not isinstance(m.get("content"), str) or m.get("tool_calls") for m in messages):
        raise MalformedRow(NONE_TEMPLATE_REASON)
    prompt = "".join(m["content"] + "\n" for m in messages[:-1])
    last = len(messages) - 1
    if labels == "all":
        flags = (not any(k in conversation.excluded for k in range(last)), last not in conversation.excluded)
    else:
        flags = (False, last in conversation.trained_messages(labels))
    return _Segments(((prompt, flags[0]), (messages[-1]["content"], flags[1])), True, exact=True)


def _encode(layouts: Sequence[_Layout], tok: TextTokenizer,
            settings: TemplateSettings) -> list[tuple[np.ndarray, np.ndarray] | str]:
    """(ids, labels) of every layout, or its malformed reason: the chats of the batch in one
    encode_chats call, every segment text in one encode_batch call."""
    out: list[tuple[np.ndarray, np.ndarray] | str] = [lay if isinstance(lay, str) else "" for lay in layouts]
    chats = [i for i, lay in enumerate(layouts) if isinstance(lay, _Chat)]
    if chats:
        controls = resolve_template(tok, settings.chat_template, settings.template_text).controls
        encoded = encode_chats(tok, [layouts[i].text for i in chats], [layouts[i].spans for i in chats],
                               controls)
        for i, result in zip(chats, encoded, strict=True):
            out[i] = result if isinstance(result, str) else _chat_labels(*result)
    segments = [i for i, lay in enumerate(layouts) if isinstance(lay, _Segments)]
    if segments:
        texts = list(dict.fromkeys(text for i in segments for text, _ in layouts[i].parts))
        encoded_texts = dict(zip(texts, tok.encode_batch(texts), strict=True))
        for i in segments:
            out[i] = _segment_labels(layouts[i], encoded_texts, tok,
                                     settings.labels == "all" and not layouts[i].exact)
    return out


def _chat_labels(ids: np.ndarray, in_span: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return ids, np.where(in_span, ids, IGNORE_INDEX).astype(np.int32)


def _segment_labels(layout: _Segments, encoded: Mapping[str, list[int]], tok: TextTokenizer,
                    label_all: bool) -> tuple[np.ndarray, np.ndarray]:
    ids: list[int] = []
    labels: list[int] = []
    for text, labeled in layout.parts:
        part = encoded[text]
        ids += part
        labels += part if labeled or label_all else [IGNORE_INDEX] * len(part)
    if layout.eos:
        if tok.eos_id is None:
            raise DataError(f"data.tokenizer={tok.name!r} has no EOS token to end text rows (data.add_eos)")
        ids.append(tok.eos_id)
        answered = not layout.exact or layout.parts[-1][1]  # none: the EOS ends the answer, labeled alike
        labels.append(tok.eos_id if answered else IGNORE_INDEX)
    return np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)


def render(conversation: Conversation, tok: TextTokenizer,
           settings: TemplateSettings) -> tuple[np.ndarray, np.ndarray]:
    """One conversation -> (ids, labels) before any length limit; MalformedRow when it cannot be rendered."""
    result = _encode([_layout(conversation, tok, settings)], tok, settings)[0]
    if isinstance(result, str):
        raise MalformedRow(result)
    return result


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
        return ids[:0], labels[:0], RowStatus.EMPTY
    limit = settings.max_length
    if limit is None or len(ids) <= limit:
        return ids, labels, RowStatus.OK
    status = _TOO_LONG_STATUS[settings.too_long]
    if status != RowStatus.TRUNCATED:
        return ids[:0], labels[:0], status
    window = slice(len(ids) - limit, None) if settings.truncate_side == "left" else slice(0, limit)
    ids, labels = ids[window], labels[window]
    if count_label_tokens(labels) == 0:
        return ids[:0], labels[:0], RowStatus.TRUNCATED_EMPTY
    return ids, labels, status


def is_template_reason(reason: str) -> bool:
    """Whether a malformed row's reason is the chat template's (it cannot render the row), not the row's."""
    return "data.chat_template" in reason


def _layouts(rows: Sequence[Mapping[str, Any]], tok: TextTokenizer,
             settings: TemplateSettings) -> tuple[list[_Layout], list[str]]:
    """Each row's layout (or malformed reason) and row format ("" when malformed)."""
    layouts: list[_Layout] = []
    formats: list[str] = []
    columns = column_map(settings.columns)  # checked once (DataError naming data.columns)
    for row in rows:
        try:
            conversation = to_conversation(row, settings.format_type, columns)
            layouts.append(_layout(conversation, tok, settings))
            formats.append(conversation.format)
        except MalformedRow as err:
            layouts.append(str(err))
            formats.append("")
    return layouts, formats


def tokenize_rows(rows: Sequence[Mapping[str, Any]], tok: TextTokenizer,
                  settings: TemplateSettings) -> TokenizedRows:
    """Tokenize a batch of rows: each rendered once, then encoded together (module docstring)."""
    layouts, formats = _layouts(rows, tok, settings)
    out = TokenizedRows()
    empty = np.zeros(0, dtype=np.int32)
    for layout, result, row_format in zip(layouts, _encode(layouts, tok, settings), formats, strict=True):
        if isinstance(result, str):
            ids, labels, status, raw, row_format = empty, empty, RowStatus.MALFORMED, 0, ""
        else:
            ids, labels, status = _apply_limit(*result, settings)
            raw = len(result[0])
            if status == RowStatus.EMPTY and getattr(layout, "excluded", False):
                status = RowStatus.EXCLUDED
        out.input_ids.append(ids)
        out.labels.append(labels)
        out.status.append(status)
        out.raw_tokens.append(raw)
        out.reason.append(result if isinstance(result, str) else "")
        out.format.append(row_format)
    return out
