"""Property test of truncation: a usable row always trains on something, and on exactly what survived.

Random chats (1-6 messages, roles drawn from system/user/assistant, contents from a small word list) and a
random max_length (1..200), both truncate sides, the real Qwen tokenizer, data.labels=assistant. The
expectation is computed independently of app/data/template.py's truncation: tokenize WITHOUT a limit, cut
the same window out of (ids, labels) by hand, and count the labels the loss sees (the window's first token
is predicted by nothing, so its label is never a target).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer
from scheduling.payload import IGNORE_INDEX, USABLE_STATUSES, Sample

WORDS = ["the", "data", "model", "answer", "long", "context", "is", "a", "question", "what", "why", "four",
         "2+2", "?", ".", "\n", "  ", "tokens", "déjà"]
# No special-token text here: how "<|im_end|>" typed in a message is kept as text (split out and encoded
# as transformers' sanitize_control_tokens does) is tests/test_chat_templates.py's injection test.
ROLES = ["system", "user", "assistant"]
SIDES = ["left", "right"]

message = st.fixed_dictionaries({
    "role": st.sampled_from(ROLES),
    "content": st.lists(st.sampled_from(WORDS), max_size=30).map(" ".join),
})
chats = st.lists(message, min_size=1, max_size=6)


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer("qwen")


def chatml_reference(qwen, chat: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, labels) of the chat as ChatML, encoded as one string, independently of app/data/.

    ChatML's special tokens split the string, so the text between them ("{role}\\n{content}", then "\\n")
    is encoded whole by tiktoken's own encode_ordinary (special-token text in a message stays text);
    a token is labeled when its bytes overlap an assistant content, found by tiktoken's token bytes. BPE
    may merge across the header/content boundary ("\\n" then a content starting with "\\n"): that token
    overlaps the content and carries its label.
    """
    enc = qwen.backend._tokenizer
    ids: list[int] = []
    labels: list[int] = []
    for message in chat:
        assistant = message["role"] == "assistant"
        head = f"{message['role']}\n"
        lo, hi = len(head.encode()), len((head + message["content"]).encode())
        ids.append(qwen.im_start_id)
        labels.append(IGNORE_INDEX)
        position = 0
        for token in enc.encode_ordinary(head + message["content"]):
            start, position = position, position + len(enc.decode_single_token_bytes(token))
            ids.append(token)
            labels.append(token if assistant and start < hi and position > lo else IGNORE_INDEX)
        ids.append(qwen.im_end_id)
        labels.append(qwen.im_end_id if assistant else IGNORE_INDEX)
        newline = enc.encode_ordinary("\n")
        ids += newline
        labels += [IGNORE_INDEX] * len(newline)
    return ids, labels


def expected_window(ids: np.ndarray, labels: np.ndarray, max_length: int,
                    side: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(ids, labels) of the window a max_length limit keeps, and the positions (in the untruncated row)
    of the assistant tokens the loss trains on: labeled, inside the window, not the window's first."""
    start = max(0, len(ids) - max_length) if side == "left" else 0
    stop = min(len(ids), start + max_length)
    trained = [p for p in range(start + 1, stop) if labels[p] != IGNORE_INDEX]
    return ids[start:stop], labels[start:stop], trained


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=chats, max_length=st.integers(min_value=1, max_value=200), side=st.sampled_from(SIDES))
def test_usable_rows_train_on_exactly_the_surviving_assistant_tokens(qwen, chat, max_length: int,
                                                                     side: str) -> None:
    row = [{"messages": chat}]
    out = tokenize_rows(row, qwen, TemplateSettings(labels="assistant", max_length=max_length,
                                                    too_long="truncate", truncate_side=side))
    status, ids, labels = out.status[0], out.input_ids[0], out.labels[0]
    assert status in ("ok", "truncated", "empty", "truncated_empty")
    event(status)  # --hypothesis-show-statistics: every status is reached
    if status not in USABLE_STATUSES:  # never trained: no ids, no labels
        assert len(ids) == len(labels) == out.label_tokens[0] == out.num_tokens[0] == 0
    whole = tokenize_rows(row, qwen, TemplateSettings(labels="assistant"))
    assert whole.raw_tokens[0] == out.raw_tokens[0]
    has_answer = any(m["role"] == "assistant" for m in chat)
    # An assistant message always labels its <|im_end|>, never the row's first token: the row is empty
    # (before any limit) exactly when the chat has no assistant message.
    assert (whole.status[0] == "empty") == (status == "empty") == (not has_answer)
    if not has_answer:
        return
    full_ids, full_labels = whole.input_ids[0], whole.labels[0]
    # The untruncated row is the whole ChatML string encoded at once, labeled on the tokens that overlap
    # an assistant message's content, plus its <|im_end|>, and nothing else.
    ref_ids, ref_labels = chatml_reference(qwen, chat)
    assert full_ids.tolist() == ref_ids and full_labels.tolist() == ref_labels
    win_ids, win_labels, trained = expected_window(full_ids, full_labels, max_length, side)
    if status == "truncated_empty":
        assert len(full_ids) > max_length and trained == []
        return
    assert status == ("ok" if len(full_ids) <= max_length else "truncated")
    assert ids.tolist() == win_ids.tolist() and labels.tolist() == win_labels.tolist()
    # What the loss sees: targets = labels[1:]; they are exactly the surviving assistant tokens.
    assert out.label_tokens[0] == Sample(sample_id=0, input_ids=ids, labels=labels).num_label_tokens
    assert out.label_tokens[0] == len(trained) >= 1
    assert labels[1:][labels[1:] != IGNORE_INDEX].tolist() == full_ids[trained].tolist()
