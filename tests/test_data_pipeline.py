"""The Ray Data pipeline: every reader, the synthetic source, order, statuses, scan errors (one local Ray)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from data_rows import example_rows, expected_statuses, write_all_formats

from app.config import load_config
from app.data import DataError
from app.data.pipeline import scan_dataset, tokenized_dataset
from app.data.synth import ConversationSynth, synth_conversations, target_lengths
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> tuple[list[dict], dict[str, Path]]:
    rows = example_rows()
    return rows, write_all_formats(tmp_path_factory.mktemp("data"), rows)


def config(*overrides: str):
    base = ["scheduling.bucket_size=4096", "parallel.cp_size=1", "data.tokenize_batch_size=8"]
    return load_config(None, [*base, *overrides])


def tokenized(cfg):
    return tokenized_dataset(cfg.data, max_length=cfg.max_sequence_length, num_cpus=cfg.resources.data_cpus)


def scan(cfg):
    return scan_dataset(tokenized(cfg), cfg.data, max_length=cfg.max_sequence_length)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "hf"])
def test_readers_tokenize_in_order(local_ray, formats, fmt: str) -> None:
    rows, paths = formats
    got = tokenized(config("data.source=path", f"data.path={paths[fmt]}")).take_all()
    assert [r["status"] for r in got] == expected_statuses(fmt)
    ref = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings())
    for row, ids, labels in zip(got, ref.input_ids, ref.labels, strict=False):
        assert list(row["input_ids"]) == ids.tolist() and list(row["labels"]) == labels.tolist()
        assert row["num_tokens"] == len(ids)


def test_synthetic_source_equals_generated_rows(local_ray) -> None:
    cfg = config("data.source=synthetic", "data.distribution=lmsys", "data.num_samples=40", "data.seed=9",
                 "data.length_scale=0.2")
    got = tokenized(cfg).take_all()
    synth = ConversationSynth(load_tokenizer("qwen"))
    targets = np.maximum(target_lengths("lmsys", 40, 9, 0.2), synth.min_length())
    conversations = synth_conversations(synth, np.arange(40), targets, "lmsys", seed=9)
    ref = tokenize_rows([{"messages": c} for c in conversations], synth.tok, TemplateSettings())
    assert [r["num_tokens"] for r in got] == targets.tolist()
    assert all(list(r["input_ids"]) == ids.tolist() for r, ids in zip(got, ref.input_ids, strict=True))


def test_scan_counts_and_too_long_policies(local_ray, formats) -> None:
    rows, paths = formats
    ok_lengths = [len(ids) for ids, status in zip(*_ref(rows), strict=True) if status == "ok"]
    base = ("data.source=path", f"data.path={paths['hf']}")  # the quickest reader to start
    result = scan(config(*base))
    assert result.num_rows == len(rows) and result.lengths.tolist() == ok_lengths
    assert result.counts == {"ok": len(ok_lengths), "empty": 1, "malformed": 2, "truncated": 0, "dropped": 0,
                           "too_long": 0}
    limit = 150
    num_long = sum(n > limit for n in ok_lengths)
    assert num_long > 0
    truncated = scan(config(*base, f"data.max_length={limit}", "data.too_long=truncate"))
    assert truncated.counts["truncated"] == num_long and truncated.lengths.max() == limit
    assert truncated.lengths.tolist() == [min(n, limit) for n in ok_lengths]
    with pytest.raises(DataError, match=r"data.too_long=truncate.*scheduling.bucket_size"):
        scan(config(*base, f"data.max_length={limit}", "data.too_long=error"))


def test_missing_path_and_no_usable_rows(local_ray, tmp_path) -> None:
    with pytest.raises(DataError, match="data.path"):
        tokenized(config("data.source=path", f"data.path={tmp_path / 'missing'}"))
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(DataError, match=r"no usable rows in data.path.*empty=1, malformed=1"):
        scan(config("data.source=path", f"data.path={junk}"))


def _ref(rows: list[dict]) -> tuple[list[np.ndarray], list[str]]:
    out = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings())
    return out.input_ids, out.status
