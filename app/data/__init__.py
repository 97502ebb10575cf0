"""Data: dataset readers, row formats, chat-template tokenization on Ray Data, synthetic conversations.

    app/data/
    ├── tokenizer.py   load_tokenizer(data.tokenizer) -> TextTokenizer (offline Qwen BPE or a HF tokenizer)
    ├── conversation.py  Conversation: the one row shape every format produces and the template renders
    ├── formats/       row formats behind a registry (messages, sharegpt, alpaca, prompt_completion, text),
    │                  data.columns mapping, auto detection per row, per-message train / weight (fields.py)
    ├── chat_template.py / chat_encode.py  data.chat_template resolution, transformers rendering, label spans
    ├── template.py    one row -> Conversation -> input_ids, labels, status, label_tokens, format  (pure)
    ├── preview.py     `data preview`: the first rows as training sees them, decoded, labels highlighted
    ├── synth.py       seeded Markov-chain chat conversations with exact target token lengths (pure)
    ├── readers.py     format detection, ordered file lists, local (Ray-free) row batches
    ├── sources.py     data.sources (or data.path) resolved per dataset: files, rows, take, checks naming
    │                  the source; the mix's stream read locally (preview, plan; scheduling/mix.py)
    ├── hub.py         data.source=hf: datasets.load_dataset(path, name, split, data_files), once per process
    ├── ray_ops.py     the callable classes Ray Data runs in `map_batches` (generate, tokenize)
    ├── pipeline.py    tokenized_dataset(resolved, num_cpus, tasks): the Ray Data pipeline, stream order
    ├── concurrency.py tokenize tasks at once (data.tokenize_concurrency)
    ├── ray_env.py     Ray Data settings of the driver process (set by `python -m app` at its start)
    ├── scan.py        scan_dataset / ScanTally -> DataScan: the data summary and the checks before training
    ├── prepared.py    a prepared set: its manifest, the identity check, reading its shards without Ray
    ├── prepare.py     `data prepare` on Ray: tokenize once, Parquet shards in stream order, the manifest
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
