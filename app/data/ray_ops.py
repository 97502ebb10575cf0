"""The functions Ray Data runs in `map_batches`, and the classes behind them.

    ray.data.range(n) --SynthesizeBatch--> {sample_id, messages}          (data.source: synthetic)
    read_parquet / read_text / from_arrow --> {every column of the rows | json_line rows}
        --TokenizeBatch--> {input_ids list<int32>, labels list<int32>, num_tokens, raw_tokens, label_tokens,
                            status, reason ("" unless status is malformed), format (the row format)}

`tokenize` and `synthesize_and_tokenize` are plain functions, so Ray Data runs them as tasks fused with the
read into one task (an actor-pool map would be a process of its own beside the read task, ~2-4 s of CPU to
start); each builds its classes once per worker process (the constructors load the tokenizer), keyed by
their arguments (fixed for a job, whose task workers Ray reuses). Both take and return pyarrow Tables
(`batch_format="pyarrow"`); the token columns are built as Arrow list arrays from one flat int32 buffer
plus offsets, not from per-row Python lists. Nothing here imports Ray.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa

from app.data.synth import ConversationSynth, synth_conversations, target_lengths
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
TOKENIZED_COLUMNS = ("input_ids", "labels", "num_tokens", "raw_tokens", "label_tokens", "status", "reason",
                     "format")
"""A tokenized row (TokenizeBatch's output): what the planner, the scan and `data prepare` read."""


class SynthesizeBatch:
    """Batch of `ray.data.range` ids -> synthetic conversations of the configured target lengths.

    The targets of all num_samples are drawn once in the constructor (same seed as `data synth`), so
    a row depends only on its id: the in-memory source equals `data synth --n num_samples` row for row.
    """

    def __init__(self, tokenizer: str, distribution: str, num_samples: int, seed: int,
                 length_scale: float) -> None:
        self.synth = ConversationSynth(load_tokenizer(tokenizer))
        self.distribution = distribution
        self.seed = seed
        self.targets = target_lengths(distribution, num_samples, seed, length_scale)

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column("id").to_numpy().astype(np.int64)
        conversations = synth_conversations(self.synth, ids, self.targets[ids], self.distribution, self.seed)
        return pa.table({"sample_id": pa.array(ids, pa.int64()),
                         "messages": pa.array(conversations, MESSAGES_TYPE)})


class TokenizeBatch:
    """Batch of rows -> tokenized rows (see app/data/template.py for the template, labels and statuses).

    json_lines: the batch is `ray.data.read_text` output whose `text` column holds raw JSONL lines.
    """

    def __init__(self, tokenizer: str, settings: TemplateSettings, json_lines: bool = False) -> None:
        self.tok = load_tokenizer(tokenizer)
        self.settings = settings
        self.json_lines = json_lines

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = tokenize_rows(self._rows(batch), self.tok, self.settings)
        return pa.table({
            "input_ids": int32_lists(out.input_ids), "labels": int32_lists(out.labels),
            "num_tokens": pa.array(out.num_tokens, pa.int64()),
            "raw_tokens": pa.array(out.raw_tokens, pa.int64()),
            "label_tokens": pa.array(out.label_tokens, pa.int64()),
            "status": pa.array(out.status, pa.string()),
            "reason": pa.array(out.reason, pa.string()),
            "format": pa.array(out.format, pa.string()),
        })

    def _rows(self, batch: pa.Table) -> list[dict[str, Any]]:
        if self.json_lines:
            return [{"json_line": line} for line in batch.column("text").to_pylist()]
        return batch.to_pylist()  # every column: the row format decides which it reads (app/data/formats/)


def tokenize(batch: pa.Table, tokenize: tuple[Any, ...]) -> pa.Table:
    """TokenizeBatch(*tokenize)(batch): rows of data.path -> tokenized rows."""
    return _tokenizer_of(*tokenize)(batch)


def synthesize_and_tokenize(batch: pa.Table, synthesize: tuple[Any, ...],
                            tokenize: tuple[Any, ...]) -> pa.Table:
    """SynthesizeBatch(*synthesize), then TokenizeBatch(*tokenize): the synthetic source in one task."""
    return _tokenizer_of(*tokenize)(_synthesizer_of(*synthesize)(batch))


@functools.lru_cache(maxsize=4)
def _synthesizer_of(*args: Any) -> SynthesizeBatch:
    return SynthesizeBatch(*args)


@functools.lru_cache(maxsize=4)
def _tokenizer_of(*args: Any) -> TokenizeBatch:
    return TokenizeBatch(*args)


def int32_lists(arrays: list[np.ndarray]) -> pa.ListArray:
    """Arrow list<int32> from per-row int32 arrays: one concatenated buffer plus int32 offsets."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int32, copy=False)))
