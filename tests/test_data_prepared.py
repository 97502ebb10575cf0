"""Prepared datasets without Ray: the shards and the manifest, the identity check, preview and plan reading
them, and how many tokenize tasks run at once (data.tokenize_concurrency).

The prepared set here is written by the function Ray Data runs (ray_ops.tokenize with a ShardTarget, one
call per block) and folded by the driver's fold_summaries, without Ray; tests/test_formats_e2e.py prepares
on Ray and trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.__main__ import main
from app.config import ConfigError, load_config
from app.data import DataError
from app.data.concurrency import tokenize_tasks
from app.data.lengths import scan_local
from app.data.prepare import fold_summaries
from app.data.prepared import MANIFEST, read_manifest
from app.data.preview import preview_rows
from app.data.ray_ops import MESSAGES_TYPE, ShardTarget, tokenize
from app.data.resolved import resolve_data
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer
from tests.data_rows import example_rows

BASE = ["data.source=path", "scheduling.bucket_size=4096", "parallel.cp_size=1",
        "data.max_malformed_fraction=1"]


def _table(rows: list[dict]) -> pa.Table:
    return pa.table({"messages": pa.array([r["messages"] for r in rows], MESSAGES_TYPE),
                     "text": pa.array([r["text"] for r in rows], pa.string())})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[str]]:
    """(prepared dir, the raw rows, the config overrides that read it): blocks of 7, 6 and 16 rows, the
    summaries of the last two handed on as one block (as Ray Data's block shaping may)."""
    root = tmp_path_factory.mktemp("prepared")
    rows = example_rows()
    pq.write_table(_table(rows), root / "raw.parquet")
    raw = load_config(None, [*BASE, f"data.path={root / 'raw.parquet'}"])
    data = resolve_data(raw.data, max_length=raw.max_sequence_length)
    out = root / "set"
    out.mkdir()
    args, target = tuple(source.spec("qwen") for source in data.sources), ShardTarget(str(out))
    table = _table(rows)
    spans = ((0, 7), (7, 6), (13,))
    first, second, third = (next(tokenize(table.slice(*span), args, write=target)) for span in spans)
    record, scan = fold_summaries(data, [first, pa.concat_tables([second, third])],
                                  max_length=raw.max_sequence_length)
    (out / MANIFEST).write_text(json.dumps(record))
    assert scan.num_rows == len(rows)
    return out, rows, [*BASE, "data.source=prepared", f"data.path={out}"]


def test_shards_hold_the_rows_in_stream_order_and_the_manifest_counts_them(prepared) -> None:
    out, rows, _ = prepared
    manifest = json.loads((out / MANIFEST).read_text())
    assert [count for _, count in manifest["shards"]] == [7, 6, len(rows) - 13]
    names = [name for name, _ in manifest["shards"]]
    assert sorted(p.name for p in out.glob("part-*.parquet")) == sorted(names)
    table = pa.concat_tables(pq.read_table(out / name) for name, _ in manifest["shards"])
    ref = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings(max_length=4096))
    assert [list(ids) for ids in table.column("input_ids").to_pylist()] == [r.tolist() for r in ref.input_ids]
    assert table.column("labels").to_pylist() == [r.tolist() for r in ref.labels]
    assert manifest["rows"] == len(rows) and manifest["counts"] == {"ok": 25, "empty": 1, "malformed": 2}
    assert manifest["identity"]["data.max_length"] == 4096
    assert manifest["source"]["data.source"] == "path" and manifest["source"]["fingerprint"]["files"]


def test_a_prepared_set_resolves_once_with_its_shards_and_fingerprint(prepared) -> None:
    out, rows, overrides = prepared
    config = load_config(None, overrides)
    data = resolve_data(config.data, max_length=config.max_sequence_length)
    assert data.manifest is not None and data.source.format == "prepared"
    names = [name for name, _ in json.loads((out / MANIFEST).read_text())["shards"]]
    assert data.source.files == tuple(str(out / name) for name in names)
    fingerprint = data.fingerprints["data.path"]
    assert [name for name, _, _ in fingerprint["files"]] == names
    assert fingerprint["prepared_from"] == read_manifest(config.data).source["fingerprint"]


@pytest.mark.parametrize(("override", "knobs"), [
    ("data.tokenizer=tok.json", ["data.tokenizer", "data.chat_template"]),  # auto: its own template
    ("data.chat_template=none", ["data.chat_template"]),
    ("data.max_length=100", ["data.max_length"]),
    ("scheduling.bucket_size=2048", ["data.max_length"]),
    ("data.labels=all", ["data.labels"]),
])
def test_a_set_prepared_with_other_settings_is_exit_2_naming_the_knob(prepared, override, knobs, capsys,
                                                                      tmp_path: Path) -> None:
    *_, overrides = prepared
    if override.startswith("data.tokenizer"):  # another vocabulary: a tiny BPE of its own
        from tests.chat_fixtures import build_llama3_tokenizer

        override = f"data.tokenizer={build_llama3_tokenizer(tmp_path / 'tok')}"
    argv = ["data", "preview", "-n", "1", *[a for o in [*overrides, override] for a in ("--set", o)]]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "was prepared with other settings" in error and "prepare it again" in error, error
    for knob in knobs:
        assert f"{knob}: prepared with" in error, error
    assert error.count(": prepared with") == len(knobs)


def test_a_directory_without_a_manifest_or_with_a_broken_one_names_data_path(prepared, tmp_path) -> None:
    with pytest.raises(DataError, match=r"data.path=.* is not a prepared dataset .*data prepare"):
        read_manifest(load_config(None, ["data.source=prepared", f"data.path={tmp_path}"]).data)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match=r"is not a `data prepare` manifest"):
        read_manifest(load_config(None, ["data.source=prepared", f"data.path={tmp_path}"]).data)
    out, _, overrides = prepared
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MANIFEST).write_text((out / MANIFEST).read_text())  # the manifest without its shards
    config = load_config(None, [*overrides, f"data.path={broken}"])
    with pytest.raises(DataError, match=r"a shard its skrull_prepared.json lists cannot be read"):
        resolve_data(config.data, max_length=config.max_sequence_length)


def test_preview_and_plan_read_the_rows_as_prepared(prepared) -> None:
    out, rows, overrides = prepared
    config = load_config(None, overrides)
    previewed, _ = preview_rows(config, 8)
    ref = tokenize_rows(rows[:8], load_tokenizer("qwen"), TemplateSettings(max_length=4096))
    assert [r.input_ids for r in previewed] == [ids.tolist() for ids in ref.input_ids]
    assert [r.status for r in previewed] == ref.status and previewed[6].reason == ref.reason[6]
    scanned = scan_local(config.data, limit=20, max_length=config.max_sequence_length)
    first20 = tokenize_rows(rows[:20], load_tokenizer("qwen"), TemplateSettings(max_length=4096))
    assert scanned.lengths.tolist() == [n for n, s in zip(first20.num_tokens, first20.status, strict=True)
                                        if s == "ok"]
    assert scanned.malformed.rows == 20 and scanned.malformed.count == 2


def test_tokenize_concurrency_auto_leaves_the_training_reservation() -> None:
    config = load_config("configs/tiny-cpu.yaml", [])  # 2 workers x 0.5 CPU, planner 0, data_cpus 0.5
    assert tokenize_tasks(config, 4.0, cores=2) == 2       # (4 - 1) / 0.5 = 6; Ray on this 2-core machine
    assert tokenize_tasks(config, 4.0) == 6                # a cluster: what its nodes declare
    assert tokenize_tasks(config, 4.0, training=False) == 8
    assert tokenize_tasks(config, 1.2) == 1                # never below one task
    wide = load_config("configs/tiny-cpu.yaml", ["resources.data_cpus=1", "resources.planner_cpus=2"])
    assert tokenize_tasks(wide, 64.0) == 64 - 1 - 2
    fixed = load_config("configs/tiny-cpu.yaml", ["data.tokenize_concurrency=3"])
    assert tokenize_tasks(fixed, 64.0, cores=2) == 3
    with pytest.raises(ConfigError, match="data.tokenize_concurrency"):
        load_config(None, ["data.tokenize_concurrency=0"])
    with pytest.raises(ConfigError, match="data.tokenize_concurrency"):
        load_config(None, ["data.tokenize_concurrency=many"])
