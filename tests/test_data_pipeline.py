"""The Ray Data pipeline: every reader, the synthetic source, order, statuses, scan errors (one local Ray)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from data_rows import example_rows, expected_statuses, write_all_formats

from app.config import load_config
from app.data import DataError
from app.data.pipeline import tokenized_dataset
from app.data.resolved import resolve_data
from app.data.scan import scan_dataset
from app.data.synth import ConversationSynth, synth_conversations, target_lengths
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> tuple[list[dict], dict[str, Path]]:
    rows = example_rows()
    return rows, write_all_formats(tmp_path_factory.mktemp("data"), rows)


def config(*overrides: str):
    # The example rows hold malformed rows on purpose; tests/test_malformed_rows.py tests the limit.
    base = ["scheduling.bucket_size=4096", "parallel.cp_size=1", "data.tokenize_batch_size=8",
            "data.max_malformed_fraction=1"]
    return load_config(None, [*base, *overrides])


def tokenized(cfg):
    data = resolve_data(cfg.data, max_length=cfg.max_sequence_length)
    return tokenized_dataset(data, num_cpus=cfg.resources.data_cpus)


def scan(cfg):
    return scan_dataset(tokenized(cfg), cfg.data, max_length=cfg.max_sequence_length)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "hf"])
def test_readers_tokenize_in_order(local_ray, formats, fmt: str) -> None:
    rows, paths = formats
    got = tokenized(config("data.source=path", f"data.path={paths[fmt]}")).take_all()
    assert [r["status"] for r in got] == expected_statuses(fmt)
    ref = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings())
    for row, ids, labels, label_tokens in zip(got, ref.input_ids, ref.labels, ref.label_tokens, strict=False):
        assert list(row["input_ids"]) == ids.tolist() and list(row["labels"]) == labels.tolist()
        assert row["num_tokens"] == len(ids) and row["label_tokens"] == label_tokens


@pytest.mark.parametrize("fmt", ["jsonl", "hf"])
def test_several_tokenize_tasks_keep_the_order_of_one(local_ray, formats, fmt: str, monkeypatch) -> None:
    """Three tasks at once (blocks of ~1 kB: the jsonl read split by Ray Data, the in-memory hf table
    repartitioned) hand on exactly the rows of a single-task run, row by row."""
    import re

    from app.data import pipeline

    monkeypatch.setattr(pipeline, "BLOCK_BYTES", 1000)
    _, paths = formats
    cfg = config("data.source=path", f"data.path={paths[fmt]}")
    data = resolve_data(cfg.data, max_length=cfg.max_sequence_length)
    one = tokenized_dataset(data, num_cpus=0.5, tasks=1).take_all()
    several = tokenized_dataset(data, num_cpus=0.5, tasks=3).materialize()
    ran = re.search(r"MapBatches\(tokenize\): (\d+) tasks executed", several.stats())
    assert ran is not None and int(ran.group(1)) >= 3, several.stats()
    rows = several.take_all()
    assert len(rows) == len(one) == len(expected_statuses(fmt))
    for position, (got, want) in enumerate(zip(rows, one, strict=True)):
        assert list(got["input_ids"]) == list(want["input_ids"]), position
        assert list(got["labels"]) == list(want["labels"]), position
        assert got["status"] == want["status"], position


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
    assert result.counts == {"ok": len(ok_lengths), "empty": 1, "malformed": 2, "truncated": 0,
                             "truncated_empty": 0, "dropped": 0, "too_long": 0, "excluded": 0}
    ref = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings())
    assert result.label_tokens == sum(ref.label_tokens) > 0
    assert result.summary().startswith(f"data: {len(ok_lengths)}/{len(rows)} rows usable, {sum(ok_lengths)} "
                                       f"tokens ({result.label_tokens} label tokens), empty=1, malformed=2")
    limit = 150
    num_long = sum(n > limit for n in ok_lengths)
    assert num_long > 0
    truncated = scan(config(*base, f"data.max_length={limit}", "data.too_long=truncate"))
    # The default side is left: these chats end with an answer, so every cut row keeps label tokens.
    assert truncated.counts["truncated"] == num_long and truncated.lengths.max() == limit
    assert truncated.counts["truncated_empty"] == 0
    assert truncated.lengths.tolist() == [min(n, limit) for n in ok_lengths]
    with pytest.raises(DataError, match=r"data.too_long=truncate.*scheduling.bucket_size"):
        scan(config(*base, f"data.max_length={limit}", "data.too_long=error"))


@pytest.mark.parametrize(("side", "limit"), [("left", 12), ("right", 12), ("right", 40)])
def test_truncation_counts_match_the_template(local_ray, formats, side: str, limit: int) -> None:
    """truncated / truncated_empty and the label tokens of the summary, for both sides, against the pure
    template; every usable row of the stream has a label token after the shift."""
    rows, paths = formats
    settings = ("data.source=path", f"data.path={paths['hf']}", f"data.max_length={limit}",
                "data.too_long=truncate", f"data.truncate_side={side}")
    cfg = config(*settings)
    dataset = tokenized(cfg).materialize()  # as the driver does: one tokenization feeds rows and scan
    got = dataset.take_all()
    ref = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings(max_length=limit, too_long="truncate",
                                                                       truncate_side=side))
    assert [r["status"] for r in got] == ref.status
    assert [r["label_tokens"] for r in got] == ref.label_tokens
    assert all(r["label_tokens"] >= 1 for r in got if r["status"] in ("ok", "truncated"))
    result = scan_dataset(dataset, cfg.data, max_length=cfg.max_sequence_length)
    assert result.counts["truncated_empty"] == ref.status.count("truncated_empty")
    assert result.label_tokens == sum(ref.label_tokens)
    if side == "right":  # the first 12 or 40 tokens of these chats are mostly prompt
        assert result.counts["truncated_empty"] > 0
        assert f"truncated_empty={result.counts['truncated_empty']}" in result.summary()


def test_missing_path_and_no_usable_rows(local_ray, tmp_path) -> None:
    with pytest.raises(DataError, match="data.path"):
        tokenized(config("data.source=path", f"data.path={tmp_path / 'missing'}"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "part-0.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"data.path file .*part-0.parquet' cannot be read: it is empty"):
        tokenized(config("data.source=path", f"data.path={broken}"))
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(DataError, match=r"no usable rows in data.path.*empty=1, malformed=1\).*; 1 malformed "
                                        r"\(1 'bad JSON \(Expecting value\)'; first: row 1\)"):
        scan(config("data.source=path", f"data.path={junk}"))
    with pytest.raises(DataError, match=r"1 of 2 rows read \(fraction 0.5\) are malformed, above "
                                        r"data.max_malformed_fraction=0.05"):
        scan(config("data.source=path", f"data.path={junk}", "data.max_malformed_fraction=0.05"))


def _ref(rows: list[dict]) -> tuple[list[np.ndarray], list[str]]:
    out = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings())
    return out.input_ids, out.status


def _footer_readers_of(dataset) -> int:
    """The footer-reader pool size the read's ListFiles operator carries (Ray Data reads its knob when the
    read is built and ships the indexer with the plan)."""
    op = dataset._logical_plan.dag
    while op.input_dependencies:
        op = op.input_dependencies[0]
    return op.file_indexer._num_actors


def test_a_parquet_read_starts_one_footer_reader_per_ten_files(local_ray, tmp_path: Path,
                                                              monkeypatch) -> None:
    """Ray Data's default pool is 32 actors whatever the file count; the run's read asks for what its
    files can keep busy, leaves the environment as it found it, and a user's own setting wins."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.pipeline import FOOTER_ACTORS_KNOB, read_parquet

    files = []
    for i in range(23):
        files.append(str(tmp_path / f"part-{i:02d}.parquet"))
        pq.write_table(pa.table({"x": [i]}), files[-1])
    monkeypatch.delenv(FOOTER_ACTORS_KNOB, raising=False)
    assert _footer_readers_of(read_parquet(tuple(files[:1]), None)) == 1
    assert _footer_readers_of(read_parquet(tuple(files), None)) == 3
    assert FOOTER_ACTORS_KNOB not in os.environ
    monkeypatch.setenv(FOOTER_ACTORS_KNOB, "7")
    assert _footer_readers_of(read_parquet(tuple(files), None)) == 7
    assert read_parquet(tuple(files), None).count() == 23


def test_ray_data_defaults_keep_the_users_setting() -> None:
    from app.data.ray_env import RAY_DATA_DRIVER_DEFAULTS, apply_ray_data_defaults

    environ: dict[str, str] = {}
    apply_ray_data_defaults(environ)
    assert environ == RAY_DATA_DRIVER_DEFAULTS
    environ = {"RAY_DATA_METADATA_PREFETCH_ON_THREAD": "1"}
    apply_ray_data_defaults(environ)
    assert environ == {"RAY_DATA_METADATA_PREFETCH_ON_THREAD": "1"}


def test_a_mix_on_ray_is_the_stream_the_preview_shows(local_ray, tmp_path) -> None:
    """data.sources (issue 55): three files of three row formats read on Ray (each row's file in `path`, the
    reads unioned, one tokenize map of two tasks) give the planner, through the weighted interleave, the
    rows `data preview` shows, in its order; the scan's shares are the weights'."""
    from app.data.preview import preview_rows
    from app.data.sources import mix_spec
    from scheduling.actor import read_row_table
    from scheduling.mix import stream_rows
    from tests.test_data_mix import mix_overrides, write_sources

    paths = write_sources(tmp_path / "mix", scale=0.2)
    cfg = load_config(None, mix_overrides(paths, "data.tokenize_batch_size=32"))
    data = resolve_data(cfg.data, max_length=cfg.max_sequence_length)
    dataset = tokenized_dataset(data, num_cpus=cfg.resources.data_cpus, tasks=2).materialize()
    result = scan_dataset(dataset, cfg.data, max_length=cfg.max_sequence_length)
    shares = {name: s["share"] for name, s in result.sources.items()}
    assert shares == {"chat": 0.6, "share": 0.2, "alpaca": 0.2}
    table = read_row_table(dataset)
    stream = stream_rows(table.source_codes, table.source_names, tuple(e.source_id for e in cfg.data.sources),
                         mix_spec(cfg.data))
    shown, _ = preview_rows(cfg, 100)
    for position, row in enumerate(shown):
        ids, labels = table.tokens(int(stream.table_rows[position]))
        source = table.source_names[table.source_codes[int(stream.table_rows[position])]]
        assert (source, ids.tolist(), labels.tolist()) == (row.source, row.input_ids, row.labels), position
