"""Token lengths of a run's dataset without Ray, for the `plan` dry run.

    data.source=path       read rows locally (pyarrow / datasets / JSONL lines), tokenize them with the same
                           template code Ray Data runs, and keep the lengths of usable rows
    data.source=synthetic  the synthetic targets (the generator hits them exactly: see app/data/synth.py),
                           raised to the shortest conversation the template allows

No length limit is applied: the caller compares the lengths with SkrullConfig.max_sequence_length itself.
Malformed rows are counted by reason over the rows read; above data.max_malformed_fraction `plan` stops
with the same DataError as the pre-start scan of `train` (app/data/malformed.py).
"""

from __future__ import annotations

import numpy as np

from app.config import DataConfig
from app.data.malformed import MalformedTally, check_malformed
from app.data.readers import iter_local_rows, resolve_source
from app.data.synth import ConversationSynth, target_lengths
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer


def dataset_token_lengths(data: DataConfig, limit: int | None = None) -> np.ndarray:
    """Token counts (int64, stream order) of the first `limit` rows (all when None) that are usable.

    Empty and malformed rows are skipped, as the training stream skips them; `limit` counts rows read.
    DataError (app/data/malformed.py) when the malformed rows read exceed data.max_malformed_fraction.
    """
    tok = load_tokenizer(data.tokenizer)
    if data.source == "synthetic":
        num = data.num_samples if limit is None else min(limit, data.num_samples)
        targets = target_lengths(data.distribution, data.num_samples, data.seed, data.length_scale)[:num]
        return np.maximum(targets, ConversationSynth(tok).min_length())
    settings = TemplateSettings(chat_template=data.chat_template, labels=data.labels, max_length=None)
    lengths: list[int] = []
    malformed = MalformedTally()
    remaining = limit
    for rows in iter_local_rows(resolve_source(data), data.tokenize_batch_size):
        if remaining is not None:
            rows = rows[:remaining]
            remaining -= len(rows)
        out = tokenize_rows(rows, tok, settings)
        malformed.add(out.status, out.reason)
        lengths += [n for n, status in zip(out.num_tokens, out.status, strict=True) if status == "ok"]
        if remaining == 0:
            break
    check_malformed(data, malformed)
    return np.asarray(lengths, dtype=np.int64)
