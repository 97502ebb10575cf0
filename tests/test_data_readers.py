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
                                               max_malformed_fraction=1.0, tokenizer="qwen"))
    assert lengths.dtype == np.int64 and lengths.tolist() == reference_lengths(rows)
    assert len(lengths) == expected_statuses(fmt).count("ok")
    limited = dataset_token_lengths(DataConfig(source="path", path=str(paths[fmt]), tokenizer="qwen"),
                                    limit=5)
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
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "wrong.parquet")  # a prompt without a completion
    with pytest.raises(DataError, match=r"columns \['prompt'\], which no row format reads"):
        resolve_source(DataConfig(source="path", path=str(tmp_path / "wrong.parquet")))


def test_synthetic_lengths_are_the_targets() -> None:
    data = DataConfig(source="synthetic", distribution="wikipedia", num_samples=50, seed=4, length_scale=0.1,
                      tokenizer="qwen")
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
        dataset_token_lengths(DataConfig(source="path", path=str(bad), tokenizer="qwen"))


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


# --- Row formats at the reader: every column passes through; a schema no format reads fails early --------

SHAREGPT_ROWS = [{"conversations": [{"from": "human", "value": f"question {i}"},
                                    {"from": "gpt", "value": f"answer {i}"}], "id": i} for i in range(6)]


def test_sharegpt_parquet_keeps_every_column(tmp_path) -> None:
    """A ShareGPT-keyed parquet (no messages/text column) resolves; plan's rows are pyarrow's, all columns."""
    from app.data.readers import iter_local_rows

    path = tmp_path / "sharegpt.parquet"
    pq.write_table(pa.Table.from_pylist(SHAREGPT_ROWS), path)
    source = resolve_source(DataConfig(source="path", path=str(path)))
    assert source.columns == ("conversations", "id")
    assert [row for batch in iter_local_rows(source, 4) for row in batch] == pq.read_table(path).to_pylist()
    resolve_source(DataConfig(source="path", path=str(path), format_type="sharegpt"))
    with pytest.raises(DataError, match="data.format_type=alpaca"):  # the named format must read them
        resolve_source(DataConfig(source="path", path=str(path), format_type="alpaca"))


def test_unrelated_columns_fail_naming_them(tmp_path) -> None:
    """parquet and save_to_disk data whose columns no format reads: one DataError with the columns and
    the knobs; data.columns mapping them onto a format's keys makes the same file readable."""
    import datasets

    table = pa.table({"question": ["2+2?"], "answer": ["4"]})
    path = tmp_path / "qa.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataError) as err:
        resolve_source(DataConfig(source="path", path=str(path)))
    for part in (f"data.path file '{path}'", "['question', 'answer']", "data.format_type=auto",
                 "data.columns={}"):
        assert part in str(err.value)
    mapped = DataConfig(source="path", path=str(path), columns={"prompt": "question", "completion": "answer"})
    assert resolve_source(mapped).columns == ("question", "answer")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "qa-hf"))
    with pytest.raises(DataError, match=r"data.path='.*qa-hf' has columns \['question', 'answer'\]"):
        resolve_source(DataConfig(source="path", path=str(tmp_path / "qa-hf")))


# --- data.source=hf: datasets.load_dataset ------------------------------------------------------------

_CONFIGS_README = """---
configs:
- config_name: chat
  default: true
  data_files:
  - split: train
    path: chat/train.jsonl
  - split: test
    path: chat/test.jsonl
- config_name: plain
  data_files:
  - split: train
    path: plain/train.jsonl
---
"""
PLAIN_ROWS = [{"text": f"plain text row number {i} " + "word " * i} for i in range(9)]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """A fresh datasets cache for the test, and nothing loaded yet in this process (hub.py's cache)."""
    import datasets

    from app.data import hub

    cache = tmp_path / "datasets-cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)  # datasets read the variable at import
    hub._load.cache_clear()
    yield cache
    hub._load.cache_clear()


@pytest.fixture
def dataset_dir(tmp_path) -> Path:
    """A script-less dataset directory: two configurations (README `configs`), chat with two splits."""
    root = tmp_path / "my-dataset"
    _write_jsonl(root / "chat" / "train.jsonl", SHAREGPT_ROWS[:4])
    _write_jsonl(root / "chat" / "test.jsonl", SHAREGPT_ROWS[4:])
    _write_jsonl(root / "plain" / "train.jsonl", PLAIN_ROWS)
    (root / "README.md").write_text(_CONFIGS_README)
    return root


def test_hf_source_is_load_dataset_and_loads_once(hf_cache, dataset_dir) -> None:
    """data.source=hf reads exactly what datasets.load_dataset gives for (path, name, split), in order, with
    every column, from Arrow files in the datasets cache; a second resolve_source reuses the loaded split."""
    import datasets

    from app.data.readers import iter_local_rows

    data = DataConfig(source="hf", path=str(dataset_dir), split="test")
    source = resolve_source(data)
    reference = datasets.load_dataset(str(dataset_dir), split="test")
    assert source.format == "load_dataset" and source.columns == tuple(reference.column_names)
    assert [row for batch in iter_local_rows(source, 1) for row in batch] == reference.to_list()
    assert reference.to_list() == SHAREGPT_ROWS[4:]
    assert source.files and all(Path(f).is_relative_to(hf_cache) for f in source.files)
    assert resolve_source(data).dataset is source.dataset  # loaded once per process

    plain = DataConfig(source="hf", path=str(dataset_dir), name="plain", tokenize_batch_size=4,
                       max_malformed_fraction=1.0, tokenizer="qwen")
    rows = [row for batch in iter_local_rows(resolve_source(plain), 4) for row in batch]
    assert rows == PLAIN_ROWS
    assert dataset_token_lengths(plain).tolist() == reference_lengths(PLAIN_ROWS)
    assert dataset_token_lengths(plain, limit=3).tolist() == reference_lengths(PLAIN_ROWS[:3])


def test_hf_source_errors_name_the_knob(hf_cache, dataset_dir, tmp_path) -> None:
    import datasets

    def error(**kwargs) -> str:
        with pytest.raises(DataError) as err:
            resolve_source(DataConfig(source="hf", **{"path": str(dataset_dir), **kwargs}))
        return str(err.value)

    message = error(split="validation")
    assert "data.split='validation'" in message and "['test', 'train']" in message
    message = error(name="nope")
    assert "data.name='nope'" in message and "'chat'" in message and "'plain'" in message
    assert "data.data_files=['chat/none-*.jsonl']" in error(data_files=("chat/none-*.jsonl",))
    assert "no data files" in error(path=str(tmp_path / "no-such-dir"))
    (tmp_path / "build.py").write_text("raise SystemExit('a loading script must never run')\n")
    assert "loading script" in error(path=str(tmp_path / "build.py"))
    datasets.Dataset.from_list(PLAIN_ROWS).save_to_disk(str(tmp_path / "saved"))
    assert "data.source=path" in error(path=str(tmp_path / "saved"))
    assert "row format 'messages' does not read" in error(format_type="messages")  # ShareGPT columns


_OFFLINE_PROBE = """
import json, sys, time
from app.config import DataConfig
from app.data import DataError
from app.data.readers import iter_local_rows, resolve_source

cached = resolve_source(DataConfig(source="hf", path="someorg/tiny_chat", split="test"))
rows = [row for batch in iter_local_rows(cached, 8) for row in batch]
start = time.monotonic()
try:
    resolve_source(DataConfig(source="hf", path="someorg/not_cached", split="train"))
    error = None
except DataError as err:
    error = str(err)
json.dump({"rows": rows, "format": cached.format, "error": error, "seconds": time.monotonic() - start},
          sys.stdout)
"""


def test_hub_id_offline_uses_the_cache_and_refuses_an_uncached_one(tmp_path) -> None:
    """HF_HUB_OFFLINE=1: a hub id in the datasets cache loads from it (datasets' own cache lookup); an id
    that is not cached is one DataError naming it and HF_HUB_OFFLINE, within seconds (no network wait).

    The cache entry is written by datasets' own json builder into the directory a hub download of
    `someorg/tiny_chat` fills (<cache>/someorg___tiny_chat/<config>/<version>/<hash> holding
    `tiny_chat-<split>.arrow`). A fresh interpreter: datasets and huggingface_hub read HF_HUB_OFFLINE
    when they are imported.
    """
    import json
    import os
    import subprocess
    import sys

    from datasets.packaged_modules.json.json import Json

    from app.config import REPO_ROOT

    _write_jsonl(tmp_path / "src" / "train.jsonl", SHAREGPT_ROWS[:4])
    _write_jsonl(tmp_path / "src" / "test.jsonl", SHAREGPT_ROWS[4:])
    cache = tmp_path / "cache"
    files = {split: str(tmp_path / "src" / f"{split}.jsonl") for split in ("train", "test")}
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name="tiny_chat", config_name="default",
                   data_files=files)
    builder.download_and_prepare(output_dir=str(cache / "someorg___tiny_chat" / "default" / "0.0.0" / "0a1b"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env |= {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "HF_DATASETS_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", _OFFLINE_PROBE], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["format"] == "load_dataset" and result["rows"] == SHAREGPT_ROWS[4:]
    assert "data.path='someorg/not_cached'" in result["error"] and "HF_HUB_OFFLINE" in result["error"]
    assert result["seconds"] < 15
