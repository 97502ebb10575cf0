"""Readers without Ray: format detection, ordered files, and dataset_token_lengths for parquet/jsonl/hf."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.config import DataConfig
from app.data import DataError
from app.data.lengths import dataset_token_lengths
from app.data.ray_ops import MESSAGES_TYPE
from app.data.readers import resolve_source
from app.data.synth import ConversationSynth, synth_conversations
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer

NUM_GOOD = 24
# Rows every format can hold (parquet/hf have typed columns, so no wrong-type rows there).
BAD_ROWS = [
    {"messages": [], "text": None},                                          # empty
    {"messages": None, "text": "a plain text row"},                          # ok, text
    {"messages": None, "text": None},                                        # malformed
    {"messages": [{"role": None, "content": "x"}], "text": None},            # malformed
]
BAD_STATUSES = ["empty", "ok", "malformed", "malformed"]


def example_rows() -> list[dict]:
    """NUM_GOOD synthetic chats (lengths 30..260 tokens), with the bad rows spliced in after row 5."""
    synth = ConversationSynth(load_tokenizer("qwen"))
    targets = np.linspace(30, 260, NUM_GOOD).astype(np.int64)
    good = [{"messages": c, "text": None} for c in synth_conversations(
        synth, np.arange(NUM_GOOD), targets, "lmsys", seed=7)]
    return good[:5] + BAD_ROWS + good[5:]


def write_all_formats(root: Path, rows: list[dict]) -> dict[str, Path]:
    """The same rows as a 2-file parquet dir, a .jsonl file (plus junk lines) and a HF save_to_disk dir."""
    import datasets

    table = pa.table({"messages": pa.array([r["messages"] for r in rows], MESSAGES_TYPE),
                      "text": pa.array([r["text"] for r in rows], pa.string())})
    parquet_dir = root / "parquet"
    parquet_dir.mkdir()
    half = len(rows) // 2  # file names sort in row order: part-0 then part-1
    pq.write_table(table.slice(0, half), parquet_dir / "part-0.parquet")
    pq.write_table(table.slice(half), parquet_dir / "part-1.parquet")
    jsonl = root / "rows.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "")                         # blank lines are skipped, not counted
    lines.append('{"messages": "oops"')         # truncated JSON -> malformed
    lines.append('{"messages": "a string"}')    # wrong type -> malformed
    jsonl.write_text("\n".join(lines) + "\n")
    hf_dir = root / "hf"
    datasets.Dataset(table).save_to_disk(str(hf_dir))
    return {"parquet": parquet_dir, "jsonl": jsonl, "hf": hf_dir}


def expected_statuses(fmt: str) -> list[str]:
    statuses = ["ok"] * 5 + BAD_STATUSES + ["ok"] * (NUM_GOOD - 5)
    return statuses + (["malformed", "malformed"] if fmt == "jsonl" else [])


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
