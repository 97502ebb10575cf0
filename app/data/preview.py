"""`data preview`: the first rows of a run's data exactly as training will see them.

    rows of data.path / the hub / the synthetic source     (the same readers and generator as the run;
      | data.sources' stream                                 a mix: the planner's weighted interleave)
      -> tokenize_rows with the run's template settings     (app/data/template.py: template, labels,
                                                             data.max_length and data.too_long applied)
       | a prepared set's rows as `data prepare` tokenized them (its manifest checked against the config)
      -> PreviewRow per row: status, format, source, tokens, label tokens, ids and labels (-100: no loss)
      -> decoded text in spans of equal labeling, loss-bearing spans highlighted

Decoding span by span (not token by token) keeps multi-byte characters that BPE splits across tokens
whole. Nothing here starts Ray: the rows are read the way `plan` reads them (app/data/readers.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.config import SkrullConfig
from app.data.template import count_label_tokens, tokenize_rows
from app.data.tokenizer import TextTokenizer, load_tokenizer
from scheduling.payload import IGNORE_INDEX


@dataclass(frozen=True)
class PreviewRow:
    """One row as training sees it; `labels` in the HF convention (same length as input_ids, -100 = none)."""

    index: int
    status: str
    format: str
    reason: str
    input_ids: list[int]
    labels: list[int]
    source: str = ""
    """The id of its source (data.sources' entry, the file or dataset name, or `synthetic`)."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def label_tokens(self) -> int:
        """Next-token targets as the loss counts them (labels shifted by one: app/data/template.py)."""
        return count_label_tokens(np.asarray(self.labels, dtype=np.int64))

    def as_json(self) -> dict[str, Any]:
        return {"index": self.index, "status": self.status, "format": self.format, "reason": self.reason,
                "source": self.source, "num_tokens": self.num_tokens, "label_tokens": self.label_tokens,
                "input_ids": self.input_ids, "labels": self.labels}


def source_shares(rows: list[PreviewRow]) -> dict[str, dict[str, float]]:
    """{id: {"rows", "tokens", "share"}} over the rows (tokens: what they hold after the template and the
    limit): the mix `data preview` shows."""
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        entry = out.setdefault(row.source, {"rows": 0, "tokens": 0, "share": 0.0})
        entry["rows"] += 1
        entry["tokens"] += row.num_tokens
    for entry in out.values():
        entry["share"] = round(entry["rows"] / max(len(rows), 1), 4)
    return out


def preview_rows(config: SkrullConfig, count: int) -> tuple[list[PreviewRow], TextTokenizer]:
    """The first `count` rows of the run's stream, tokenized with the run's settings, and the tokenizer."""
    from app.data.resolved import resolve_data, template_settings
    from app.data.sources import mix_spec, mixed_local_rows, resolve_sources, tokenize_by_source

    if config.data.source == "prepared":
        data = resolve_data(config.data, max_length=config.max_sequence_length)
        tokenized = itertools.islice(prepared_rows(data.source, config.data), count)
        return [_preview_row(i, row) for i, row in enumerate(tokenized)], data.tokenizer
    tok = load_tokenizer(config.data.tokenizer)
    settings = template_settings(config.data, config.max_sequence_length)
    if config.data.synthetic:
        raw = [(0, row) for row in itertools.islice(_synthetic_rows(config), count)]
        ids = ["synthetic"]
        out = tokenize_rows([row for _, row in raw], tok, settings)
    else:
        sources = resolve_sources(config.data, settings)
        stream = mixed_local_rows(sources, mix_spec(config.data), config.data.tokenize_batch_size)
        raw = list(itertools.islice(stream, count))
        ids = [source.id for source in sources]
        out = tokenize_by_source(raw, tok, sources)
    rows = [PreviewRow(index=i, status=out.status[i], format=out.format[i], reason=out.reason[i],
                       input_ids=out.input_ids[i].tolist(), labels=out.labels[i].tolist(),
                       source=ids[raw[i][0]])
            for i in range(len(raw))]
    return rows, tok


def _synthetic_rows(config: SkrullConfig) -> Iterator[dict[str, Any]]:
    from app.data.synth import ConversationSynth, synth_conversations, target_lengths

    data = config.data
    synth = ConversationSynth(load_tokenizer(data.tokenizer))
    targets = target_lengths(data.distribution, data.num_samples, data.seed, data.length_scale)
    step = 64
    for start in range(0, data.num_samples, step):
        ids = np.arange(start, min(start + step, data.num_samples), dtype=np.int64)
        for messages in synth_conversations(synth, ids, targets[ids], data.distribution, data.seed):
            yield {"messages": messages}


def decode(tok: TextTokenizer, ids: list[int]) -> str:
    """Token ids -> text, special tokens written out (the three tokenizer kinds of app/data/tokenizer.py)."""
    if not ids:
        return ""
    if tok.kind == "tokenizers":
        return tok.backend.decode(ids, skip_special_tokens=False)
    return tok.backend.decode(ids)


def labeled_spans(tok: TextTokenizer, row: PreviewRow) -> list[tuple[str, bool]]:
    """(decoded text, carries a loss) for each run of consecutive tokens labeled alike."""
    spans: list[tuple[str, bool]] = []
    pairs = zip(row.input_ids, row.labels, strict=True)
    for labeled, group in itertools.groupby(pairs, key=lambda pair: pair[1] != IGNORE_INDEX):
        spans.append((decode(tok, [token for token, _ in group]), labeled))
    return spans


def row_header(row: PreviewRow) -> str:
    """`row 0: ok, sharegpt, 57 tokens, 12 label tokens` (and the reason of a malformed row; with
    data.sources `from chat.jsonl` after the format)."""
    fmt = f", {row.format}" if row.format else ""
    fmt += f", from {row.source}" if row.source and row.source != "synthetic" else ""
    why = f" ({row.reason})" if row.reason else ""
    return (f"row {row.index}: {row.status}{why}{fmt}, {row.num_tokens} tokens, "
            f"{row.label_tokens} label tokens")


def plain_text(tok: TextTokenizer, row: PreviewRow) -> str:
    """A row for a log file: the header, then the text with loss-bearing spans inside [[ ]]."""
    body = "".join(f"[[{text}]]" if labeled else text for text, labeled in labeled_spans(tok, row))
    return f"{row_header(row)}\n{body}"


def first_usable_example(rows: Iterable[dict[str, Any]], tok: TextTokenizer) -> str | None:
    """plain_text of the first usable row of tokenized rows in stream order (a tokenized Ray dataset's
    `iter_rows()`, or prepared_rows): the `train` log's example row."""
    from scheduling.payload import USABLE_STATUSES

    for index, row in enumerate(rows):
        if str(row["status"]) in USABLE_STATUSES:
            return plain_text(tok, _preview_row(index, row))
    return None


def prepared_rows(source: Any, data: Any = None) -> Iterator[dict[str, Any]]:
    """A prepared set's tokenized rows in stream order, read with pyarrow (app/data/prepared.py); with
    `data` (its DataConfig) holding data.sources, in the order of the mix (scheduling/mix.py)."""
    from app.data.prepared import iter_rows

    if data is not None and data.sources:
        yield from _mixed_prepared_rows(source, data)
        return
    for batch in iter_rows(source, 64):
        yield from batch


def _mixed_prepared_rows(source: Any, data: Any) -> Iterator[dict[str, Any]]:
    """The stream's rows of a prepared mix: its `source` column read whole, the stream's order computed,
    then the rows fetched by table position, a slice of the stream at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.prepared import iter_rows
    from app.data.sources import mix_spec
    from scheduling.mix import stream_rows

    names = pa.concat_tables([pq.read_table(file, columns=["source"], filesystem=source.filesystem)
                              for file in source.files]).column("source").to_numpy(zero_copy_only=False)
    unique, codes = np.unique(names.astype(str), return_inverse=True)
    order = stream_rows(codes, [str(n) for n in unique], tuple(e.source_id for e in data.sources),
                        mix_spec(data)).table_rows
    for start in range(0, len(order), 64):
        wanted = order[start:start + 64]
        found: dict[int, dict[str, Any]] = {}
        position = 0
        for batch in iter_rows(source, 256):
            hits = set(range(position, position + len(batch))) & set(wanted.tolist())
            found.update({row: batch[row - position] for row in hits})
            position += len(batch)
            if len(found) == len(set(wanted.tolist())):
                break
        yield from (found[int(row)] for row in wanted)


def _preview_row(index: int, row: dict[str, Any]) -> PreviewRow:
    """A tokenized row (the pipeline's columns) as a PreviewRow."""
    return PreviewRow(index=index, status=str(row["status"]), format=str(row.get("format") or ""),
                      reason=str(row.get("reason") or ""), input_ids=np.asarray(row["input_ids"]).tolist(),
                      labels=np.asarray(row["labels"]).tolist(), source=str(row.get("source") or ""))
