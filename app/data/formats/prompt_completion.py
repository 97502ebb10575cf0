"""`prompt_completion` rows, in TRL's two forms; the loss is on the completion only.

    standard        {"prompt": "The sky is", "completion": " blue."}
                    -> segments (("The sky is", False), (" blue.", True)): plain text, no chat template;
                       the template appends EOS after the completion (data.add_eos)
    conversational  {"prompt": [{"role": "user", "content": "What color is the sky?"}],
                     "completion": [{"role": "assistant", "content": "It is blue."}]}
                    -> messages = prompt + completion, loss_from = len(prompt): only the completion's
                       assistant turns carry a loss, even when the prompt holds earlier assistant turns

as TRL's SFTTrainer reads them (completion_only_loss). Conversational messages are checked as `messages`
messages (app/data/formats/messages.py), with reasons naming `prompt[i]` / `completion[i]`; an optional
`tools` list becomes Conversation.tools. A string paired with a list is malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.data.conversation import Conversation, MalformedRow
from app.data.formats.common import is_list, tools_of, type_name
from app.data.formats.messages import checked_messages, empty_conversation
from app.data.formats.registry import RowFormat, register

NAME = "prompt_completion"


def convert(record: Mapping[str, Any]) -> Conversation:
    for key in ("prompt", "completion"):
        if record.get(key) is None:
            raise MalformedRow(f"no {key} column")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return Conversation(segments=((prompt, False), (completion, True)), format=NAME)
    if is_list(prompt) and is_list(completion):
        return conversational(prompt, completion, tools_of(record))
    raise MalformedRow(f"prompt is {type_name(prompt)} and completion {type_name(completion)}; both must be "
                       "strings or both lists of messages")


def conversational(prompt: Any, completion: Any, tools: tuple[dict[str, Any], ...]) -> Conversation:
    (head, head_out), (tail, tail_out) = checked_messages(prompt, "prompt"), checked_messages(completion,
                                                                                             "completion")
    if not head and not tail:
        return empty_conversation(NAME)
    left_out = head_out | {len(head) + k for k in tail_out}
    return Conversation(messages=(*head, *tail), tools=tools, loss_from=len(head), format=NAME,
                        excluded=frozenset(left_out))


register(RowFormat(NAME, lambda keys: {"prompt", "completion"} <= keys, convert))
