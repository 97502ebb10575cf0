"""Data: synthetic chat conversations, dataset readers, and Qwen-chat-template tokenization on Ray Data.

    app/data/
    ├── tokenizer.py   load_tokenizer(data.tokenizer) -> TextTokenizer (offline Qwen BPE or a HF tokenizer)
    ├── template.py    one row (messages | text) -> input_ids, labels, status, label_tokens  (pure)
    ├── synth.py       seeded Markov-chain chat conversations with exact target token lengths (pure)
    ├── readers.py     format detection, ordered file lists, local (Ray-free) row batches
    ├── ray_ops.py     the callable classes Ray Data runs in `map_batches` (generate, tokenize)
    ├── pipeline.py    tokenized_dataset(data_cfg, ...), scan_dataset(dataset, ...) -> DataScan
    ├── malformed.py   malformed rows by reason, first offender, the data.max_malformed_fraction check
    └── lengths.py     dataset_token_lengths(data_cfg): token counts without Ray, for the `plan` dry run

Nothing here imports torch, and nothing imports Ray at module level: pipeline.py imports it inside its
functions, and ray_ops.py holds plain classes that Ray instantiates in its actors.
"""

from __future__ import annotations

from app.config import ConfigError


class DataError(ConfigError):
    """A dataset problem found on the driver (missing path, unknown format, unusable rows).

    The message names the config knob to change (data.path, data.format, data.too_long, ...).
    """


__all__ = ["DataError"]
