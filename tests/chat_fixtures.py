"""A Llama-3-style tokenizer and chat template built offline, and one small file per row format.

The tokenizer is a byte-level BPE trained by `tokenizers` on the rows' own text, with Llama 3's special
tokens, wrapped in transformers' PreTrainedTokenizerFast and saved with a chat template modeled on Llama
3.1's (header tokens, <|eot_id|> ends a turn, BOS first, tool calls as JSON, tool results as `ipython`).
Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>"]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '{\"name\": \"' + call['function']['name'] + '\", \"parameters\": ' }}"
    "{{- call['function']['arguments'] | tojson if call['function']['arguments'] is mapping "
    "else call['function']['arguments'] }}{{- '}' }}"
    "{%- endfor %}"
    "{%- else %}{{- message['content'] | trim }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3.1's structure (its system-prompt defaults and tool preamble left out)."""

ROWS: dict[str, list[dict[str, Any]]] = {
    "sharegpt": [
        {"conversations": [{"from": "system", "value": "You are terse."},
                           {"from": "human", "value": "What is the capital of France?"},
                           {"from": "gpt", "value": "Paris."}]},
        {"conversations": [{"from": "human", "value": "Name a prime number."},
                           {"from": "gpt", "value": "Seven is prime."},
                           {"from": "human", "value": "Another one?"},
                           {"from": "gpt", "value": "Eleven."}]},
        {"conversations": [{"from": "human", "value": "Say hello."},
                           {"from": "gpt", "value": "Hello there."}]},
        {"conversations": [{"from": "human", "value": "Count to three."},
                           {"from": "gpt", "value": "One two three."}]},
    ],
    "alpaca": [
        {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour."},
        {"instruction": "Give a synonym of quick.", "input": "", "output": "Fast."},
        {"instruction": "Sum the numbers.", "input": "two and three", "output": "Five."},
        {"instruction": "Name a color.", "input": "", "output": "Blue.", "system": "Answer in one word."},
    ],
    "openai_tools": [
        {"messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny and warm"},
            {"role": "assistant", "content": "It is sunny and warm in Paris."}]},
        {"messages": [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
                      {"role": "assistant", "content": "Hello there."}]},
        {"messages": [{"role": "user", "content": "Name a prime number."},
                      {"role": "assistant", "content": "Seven is prime."}]},
        {"messages": [{"role": "user", "content": "Count to three."},
                      {"role": "assistant", "content": "One two three."}]},
    ],
    "prompt_completion": [
        {"prompt": "The capital of France is", "completion": " Paris."},
        {"prompt": "Seven is", "completion": " prime."},
        {"prompt": [{"role": "user", "content": "Say hello."}],
         "completion": [{"role": "assistant", "content": "Hello there."}]},
        {"prompt": [{"role": "user", "content": "Name a color."}],
         "completion": [{"role": "assistant", "content": "Blue."}]},
    ],
}
"""Four rows per file; the formats auto-detection must tell apart (app/data/formats/)."""


def write_format_files(directory: Path) -> dict[str, Path]:
    """One JSONL file per format under `directory`; returns format -> path."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in ROWS.items():
        paths[name] = directory / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def _corpus() -> list[str]:
    """Every string of ROWS plus the template's fixed text, to train the BPE on."""
    texts: list[str] = ["system", "user", "assistant", "ipython", '{"name": "', '", "parameters": ', "}"]

    def walk(value: Any) -> None:
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
    walk(ROWS)
    texts.append(json.dumps({"city": "Paris"}))
    return texts


def build_llama3_tokenizer(directory: Path, template: str = LLAMA3_TEMPLATE) -> Path:
    """A byte-level BPE with Llama 3's special tokens and `template`, saved as a HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    return directory
