"""Readers without Ray: format detection, ordered files, and dataset_token_lengths for parquet/jsonl/hf."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_rows import example_rows, expected_statuses, write_all_formats

from app.config import DataConfig
from app.data import DataError
from app.data.lengths import dataset_token_lengths
from app.data.readers import resolve_source
from app.data.synth import ConversationSynth, synth_conversations
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> tuple[list[dict], dict[str, Path]]:
    rows = example_rows()
    return rows, write_all_formats(tmp_path_factory.mktemp("data"), rows)


def reference_lengths(rows: list[dict]) -> list[int]:
    out = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings())
    return [n for n, status in zip(out.num_tokens, out.status, strict=True) if status == "ok"]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "hf"])
def test_formats_detected_and_lengths_match(formats, fmt: str) -> None:
    rows, paths = formats
    source = resolve_source(DataConfig(source="path", path=str(paths[fmt])))
    assert source.format == fmt
    if fmt == "parquet":
        assert [Path(f).name for f in source.files] == ["part-0.parquet", "part-1.parquet"]
    lengths = dataset_token_lengths(DataConfig(source="path", path=str(paths[fmt]), tokenize_batch_size=7))
    assert lengths.dtype == np.int64 and lengths.tolist() == reference_lengths(rows)
    assert len(lengths) == expected_statuses(fmt).count("ok")
    limited = dataset_token_lengths(DataConfig(source="path", path=str(paths[fmt])), limit=5)
    assert limited.tolist() == reference_lengths(rows)[:5]


def test_explicit_format_and_errors(formats, tmp_path) -> None:
    _, paths = formats
    explicit = DataConfig(source="path", path=str(paths["jsonl"]), format="jsonl")
    assert resolve_source(explicit).format == "jsonl"
    with pytest.raises(DataError, match="data.path"):
        resolve_source(DataConfig(source="path", path=str(tmp_path / "nope")))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="data.format"):
        resolve_source(DataConfig(source="path", path=str(tmp_path / "notes.txt")))
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "wrong.parquet")
    with pytest.raises(DataError, match="`messages` or `text`"):
        resolve_source(DataConfig(source="path", path=str(tmp_path / "wrong.parquet")))


def test_synthetic_lengths_are_the_targets() -> None:
    data = DataConfig(source="synthetic", distribution="wikipedia", num_samples=50, seed=4, length_scale=0.1)
    lengths = dataset_token_lengths(data, limit=20)
    synth = ConversationSynth(load_tokenizer("qwen"))
    from app.data.synth import target_lengths

    targets = np.maximum(target_lengths("wikipedia", 50, 4, 0.1)[:20], synth.min_length())
    conversations = synth_conversations(synth, np.arange(20), targets, "wikipedia", seed=4)
    measured = tokenize_rows([{"messages": c} for c in conversations], synth.tok, TemplateSettings())
    assert lengths.tolist() == targets.tolist() == measured.num_tokens
