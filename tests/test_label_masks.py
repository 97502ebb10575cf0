"""Per-turn loss against transformers' own rendering (issue 55, done-when 2): data.labels assistant |
last_turn | all with per-message `train: false` / `weight: 0`, on chats of 1 to 5 turns, whole and truncated.

The reference is transformers' apply_chat_template on a Llama-3-style template whose assistant turns are
marked with {% generation %}: its `assistant_masks` say which tokens an assistant writes, and the token
lengths of its renderings of each prefix of the chat say which message a token belongs to. The expected
labels follow from those two alone. The rows are tokenized by this project twice: with that marked template
(its {% generation %} path) and with the same template unmarked (the prefix method, docs/design.md §12).
"""

from __future__ import annotations

import numpy as np
import pytest

from app.data.template import TemplateSettings, count_label_tokens, tokenize_rows
from app.data.tokenizer import load_tokenizer
from scheduling.payload import IGNORE_INDEX
from tests.chat_fixtures import LLAMA3_SPECIALS
from tests.test_chat_templates import _vocabulary

MARKED = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] | trim }}{{- '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] | trim }}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
UNMARKED = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
WORDS = ["the", "model", "can", "see", "a", "helpful", "assistant", "what", "is", "weather", "Paris", "sunny",
         "city", "data", "It", "4", "And", "3+3"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import PreTrainedTokenizerFast

    dirs = {}
    for name, template in (("marked", MARKED), ("unmarked", UNMARKED)):
        tok = PreTrainedTokenizerFast(tokenizer_object=_vocabulary(LLAMA3_SPECIALS),
                                      bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
        tok.chat_template = template
        out = tmp_path_factory.mktemp(name)
        tok.save_pretrained(str(out))
        dirs[name] = str(out)
    return dirs


def chats(count: int = 12) -> list[tuple[list[dict], set[int]]]:
    """(messages, indices whose per-message field excludes them): 1 to 5 turns, a system message in some,
    exclusions on some assistant turns (the last one included) and on some user turns."""
    rng = np.random.default_rng(55)
    out = []
    for index in range(count):
        turns = index % 5 + 1
        messages = [{"role": "system", "content": "You are terse."}] if index % 3 == 0 else []
        for _ in range(turns):
            for role in ("user", "assistant"):
                words = rng.choice(WORDS, size=int(rng.integers(1, 7)))
                messages.append({"role": role, "content": " ".join(words)})
        excluded = {k for k in range(1, len(messages)) if rng.random() < 0.3}
        if index == count - 1:  # every answer left out: nothing to train (status excluded)
            excluded = {k for k, m in enumerate(messages) if m["role"] == "assistant"}
        out.append((messages, excluded))
    return out


def _marked(messages: list[dict], excluded: set[int], field: str) -> list[dict]:
    """The row as a file holds it: `train: false` or `weight: 0` on the excluded messages."""
    value = {"train": False, "weight": 0}[field]
    return [dict(m, **{field: value}) if k in excluded else dict(m) for k, m in enumerate(messages)]


def reference(hf, messages: list[dict], excluded: set[int], labels: str) -> tuple[list[int], list[int], str]:
    """(ids, expected labels, expected status before any limit) from transformers' rendering alone."""
    full = hf.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(full["input_ids"]), list(full["assistant_masks"])
    ends = [len(hf.apply_chat_template(messages[:k + 1], return_dict=True)["input_ids"])
            for k in range(len(messages))]
    starts = [0, *ends[:-1]]
    assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    rule = assistants[-1:] if labels == "last_turn" else assistants
    trained = [k for k in rule if k not in excluded]
    owner = np.zeros(len(ids), dtype=np.int64)
    for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
        owner[start:end] = k
    if labels == "all":
        keep = [owner[i] not in excluded for i in range(len(ids))]
        cut = bool(excluded)
    else:
        keep = [bool(mask[i]) and owner[i] in trained for i in range(len(ids))]
        cut = bool(set(rule) & excluded)
    expected = [t if k else IGNORE_INDEX for t, k in zip(ids, keep, strict=True)]
    status = "ok" if count_label_tokens(np.asarray(expected)) else ("excluded" if cut else "empty")
    return ids, expected, status


@pytest.mark.parametrize("template", ["marked", "unmarked"])
@pytest.mark.parametrize("labels", ["assistant", "last_turn", "all"])
def test_labels_and_exclusions_match_transformers_rendering(tokenizers, template: str, labels: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizers["marked"])
    tok = load_tokenizer(tokenizers[template])
    cases = chats()
    rows = [{"messages": _marked(m, ex, "train" if i % 2 else "weight")} for i, (m, ex) in enumerate(cases)]
    out = tokenize_rows(rows, tok, TemplateSettings(labels=labels))
    statuses = set()
    for (messages, excluded), ids, got, status in zip(cases, out.input_ids, out.labels, out.status,
                                                      strict=True):
        want_ids, want, want_status = reference(hf, messages, excluded, labels)
        assert status == want_status, (messages, excluded)
        statuses.add(status)
        if status == "ok":
            assert ids.tolist() == want_ids and got.tolist() == want, (messages, excluded)
    assert "ok" in statuses and (labels == "all" or "excluded" in statuses)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("labels", ["assistant", "last_turn"])
def test_the_masks_survive_truncation(tokenizers, side: str, labels: str) -> None:
    """too_long=truncate keeps the window of the reference's ids and labels (truncated_empty when it holds
    no label token after the shift)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizers["marked"])
    tok = load_tokenizer(tokenizers["unmarked"])
    cases = [(m, ex) for m, ex in chats() if len(m) >= 4]
    seen = set()
    for limit in (12, 30):
        settings = TemplateSettings(labels=labels, too_long="truncate", truncate_side=side, max_length=limit)
        out = tokenize_rows([{"messages": _marked(m, ex, "train")} for m, ex in cases], tok, settings)
        for (messages, excluded), ids, got, status in zip(cases, out.input_ids, out.labels, out.status,
                                                          strict=True):
            want_ids, want, whole = reference(hf, messages, excluded, labels)
            if whole != "ok" or len(want_ids) <= limit:
                assert status == whole or len(want_ids) <= limit
                continue
            window = slice(len(want_ids) - limit, None) if side == "left" else slice(0, limit)
            kept = want[window]
            expected_status = "truncated" if count_label_tokens(np.asarray(kept)) else "truncated_empty"
            assert status == expected_status
            seen.add(status)
            if status == "truncated":
                assert ids.tolist() == want_ids[window] and got.tolist() == kept
    # the first tokens of a chat hold no answer with last_turn: a right window then keeps none
    assert "truncated" in seen or (side, labels) == ("right", "last_turn")


def test_sharegpt_weight_0_equals_messages_train_false(tokenizers) -> None:
    tok = load_tokenizer(tokenizers["unmarked"])
    turns = [{"from": "human", "value": "what is 4"}, {"from": "gpt", "value": "It is 4", "weight": 0},
             {"from": "human", "value": "And 3+3"}, {"from": "gpt", "value": "It is"}]
    messages = [{"role": "user", "content": "what is 4"},
                {"role": "assistant", "content": "It is 4", "train": False},
                {"role": "user", "content": "And 3+3"}, {"role": "assistant", "content": "It is"}]
    out = tokenize_rows([{"conversations": turns}, {"messages": messages}], tok, TemplateSettings())
    assert out.labels[0].tolist() == out.labels[1].tolist() and out.status == ["ok", "ok"]
    every = tokenize_rows([{"messages": [dict(m, train=True) for m in messages]}], tok, TemplateSettings())
    assert count_label_tokens(out.labels[0]) < count_label_tokens(every.labels[0])
