"""The one internal row shape: what every row format (app/data/formats/) produces and the template renders.

    Conversation(messages=...)   a chat: OpenAI-style message dicts, rendered by the chat template
                                 (app/data/template.py); loss on assistant turns from message
                                 `loss_from` on (0: every assistant turn; prompt-completion rows in the
                                 conversational form set it to the completion's first message)
    Conversation(segments=...)   plain text pieces, each marked with whether it carries a loss: a `text`
                                 row is one labeled segment, a string prompt-completion row an unlabeled
                                 prompt and a labeled completion; the template appends EOS (data.add_eos)

Messages are plain dicts in the OpenAI / transformers chat shape, so they go to `apply_chat_template`
unchanged: {"role": "system"|"user"|"assistant"|"tool", "content": str | None, "tool_calls": [...],
"tool_call_id": str, "name": str}. Content is always a string (or None on an assistant turn that only
calls tools): adapters join list-of-parts text content before it gets here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class MalformedRow(Exception):
    """This row cannot be rendered; reported with status `malformed` and str(err) as its reason.

    The reason is a few words that do not depend on the row's position (a scan counts rows by reason,
    app/data/malformed.py): "messages[1].content is a list, not a string", "no messages or text column".
    """


@dataclass(frozen=True)
class Conversation:
    """One row, in the shape the template renders. Exactly one of `messages` / `segments` is non-empty."""

    messages: tuple[dict[str, Any], ...] = ()
    segments: tuple[tuple[str, bool], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    """Function schemas offered to the model (the template's `tools`); () for none."""
    loss_from: int = 0
    """data.labels=assistant: only assistant turns at message index >= loss_from carry a loss."""
    format: str = ""
    """The row format that produced it (app/data/formats/ registry name), shown in the data summary."""
    excluded: frozenset[int] = frozenset()
    """Messages whose `train: false` / `weight: 0` field leaves them out of the loss in every data.labels
    mode (app/data/formats/fields.py)."""

    def __post_init__(self) -> None:
        if bool(self.messages) == bool(self.segments):
            raise ValueError("a Conversation holds messages or segments, exactly one of them")
        if not 0 <= self.loss_from <= len(self.messages):
            raise ValueError(f"loss_from={self.loss_from} is outside the {len(self.messages)} messages")
        if any(not 0 <= k < len(self.messages) for k in self.excluded):
            raise ValueError(f"excluded={sorted(self.excluded)} is outside the {len(self.messages)} messages")

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    def trained_messages(self, labels: str) -> tuple[int, ...]:
        """The assistant messages whose tokens carry a loss under data.labels=assistant | last_turn: those at
        index >= loss_from (last_turn: the final one of them), less the excluded ones."""
        turns = [k for k, message in enumerate(self.messages)
                 if k >= self.loss_from and message.get("role") == "assistant"]
        if labels == "last_turn":
            turns = turns[-1:]
        return tuple(k for k in turns if k not in self.excluded)

    def excludes_a_trained_message(self, labels: str) -> bool:
        """Whether a per-message field took away a message the label rule would train (status excluded)."""
        if not self.excluded:
            return False
        if labels == "all":
            return True
        every = dataclasses.replace(self, excluded=frozenset()).trained_messages(labels)
        return bool(set(every) & self.excluded)
