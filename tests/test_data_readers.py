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
    # The example rows are partly malformed on purpose; tests/test_malformed_rows.py tests the limit.
    lengths = dataset_token_lengths(DataConfig(source="path", path=str(paths[fmt]), tokenize_batch_size=7,
                                               max_malformed_fraction=1.0))
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


@pytest.mark.parametrize(("content", "why"), [
    (b"", "it is empty \\(0 bytes\\)"),
    (b"PAR1 this is not parquet PAR1", "not a valid parquet file"),
    (b"\x00" * 64, "not a valid parquet file"),
])
def test_bad_parquet_file_is_one_data_error_naming_it(formats, tmp_path, content: bytes, why: str) -> None:
    """A 0-byte or invalid .parquet beside good ones fails on the driver, naming data.path and the file."""
    _, paths = formats
    data_dir = tmp_path / "parquet"
    data_dir.mkdir()
    for good in Path(paths["parquet"]).glob("*.parquet"):
        (data_dir / good.name).write_bytes(good.read_bytes())
    bad = data_dir / "part-9-bad.parquet"  # sorts after the good files: every file is checked, not the first
    bad.write_bytes(content)
    for fmt in ("auto", "parquet"):
        with pytest.raises(DataError, match=rf"data.path file '{bad}' cannot be read: {why}") as err:
            resolve_source(DataConfig(source="path", path=str(data_dir), format=fmt))
        cause = err.value.__cause__ or (None if err.value.__suppress_context__ else err.value.__context__)
        assert cause is None  # one message, no pyarrow traceback chained to it
    with pytest.raises(DataError, match="data.path file"):
        dataset_token_lengths(DataConfig(source="path", path=str(bad)))


def test_jsonl_that_is_not_utf8_is_one_data_error_naming_it(tmp_path) -> None:
    good = '{"text": "a plain text row"}\n'
    bad = tmp_path / "rows.jsonl"
    bad.write_bytes((good * 3 + '{"text": "caf').encode() + b"\xe9" + b'"}\n' + good.encode())
    with pytest.raises(DataError, match=rf"data.path file '{bad}' cannot be read: line 4 .*not valid UTF-8"):
        resolve_source(DataConfig(source="path", path=str(tmp_path)))
    bad.write_bytes(good.encode() + "é".encode()[:1])  # cut inside a 2-byte character at the very end
    with pytest.raises(DataError, match="ends inside a UTF-8 character"):
        resolve_source(DataConfig(source="path", path=str(bad)))
    bad.write_text(good + '{"text": "déjà vu"}\n', encoding="utf-8")  # valid multi-byte text is fine
    assert resolve_source(DataConfig(source="path", path=str(bad))).files == (str(bad),)


def test_utf8_check_spans_chunk_boundaries(tmp_path, monkeypatch) -> None:
    """Multi-byte characters split across read chunks are valid; a bad byte is placed on its line."""
    from app.data import readers

    monkeypatch.setattr(readers, "_UTF8_CHUNK", 5)
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "déjà vu, ünïcode"}\n' * 4, encoding="utf-8")
    resolve_source(DataConfig(source="path", path=str(path)))
    path.write_bytes(('{"text": "déjà"}\n' * 3).encode() + b'{"text": "\xff"}\n')
    with pytest.raises(DataError, match="line 4 "):
        resolve_source(DataConfig(source="path", path=str(path)))
