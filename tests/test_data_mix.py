"""data.sources without Ray: the weighted interleave (scheduling/mix.py), three sources of different row
formats read and mixed as `data preview` and `plan` read them, a prepared mix against the tokenizing run's
rows, what a resume and a prepared load refuse, and the bad input that stops before Ray starts (issue 55,
done-when 1 and 3; the planner's resume on a mix: tests/test_planner_actor.py, the mix on Ray:
tests/test_data_pipeline.py)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.config import ConfigError, load_config
from app.data import DataError
from app.data.prepare import fold_summaries
from app.data.prepared import MANIFEST
from app.data.preview import prepared_rows, preview_rows
from app.data.ray_ops import ShardTarget, tokenize
from app.data.readers import PATH_COLUMN
from app.data.resolved import resolve_data
from app.data.scan import ScanTally
from app.rundir.snapshot import check_resume, write_snapshot
from scheduling.mix import MixSpec, MixStream, mix_order, rows_needed, stream_rows
from scheduling.row_table import RowTable

SIZES = {"chat": 1500, "share": 700, "alpaca": 600}
WEIGHTS = (3, 1, 1)


def write_sources(root: Path, scale: float = 1.0) -> dict[str, Path]:
    """Three files of three row formats: messages (JSONL), ShareGPT (Parquet), alpaca (JSONL); SIZES rows
    times `scale`."""
    sizes = {name: int(n * scale) for name, n in SIZES.items()}
    root.mkdir(parents=True, exist_ok=True)
    paths = {"chat": root / "chat.jsonl", "share": root / "share.parquet", "alpaca": root / "alpaca.jsonl"}
    chats = [{"messages": [{"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": f"answer {i}"}]} for i in range(sizes["chat"])]
    paths["chat"].write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    pq.write_table(pa.Table.from_pylist([{"conversations": [{"from": "human", "value": f"hi {i}"},
                                                            {"from": "gpt", "value": f"hello {i}"}]}
                                         for i in range(sizes["share"])]), paths["share"])
    paths["alpaca"].write_text("".join(json.dumps({"instruction": f"do {i}", "output": f"done {i}"}) + "\n"
                                       for i in range(sizes["alpaca"])))
    return paths


def mix_overrides(paths: dict[str, Path], *more: str) -> list[str]:
    entries = ", ".join(f"{{path: {paths[name]}, weight: {w}, id: {name}}}"
                        for name, w in zip(paths, WEIGHTS, strict=True))
    return [f"data.sources=[{entries}]", "scheduling.bucket_size=1024", "parallel.cp_size=1", *more]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_sources(tmp_path_factory.mktemp("mix"))


def _shares(sources: np.ndarray, n: int = 2000) -> np.ndarray:
    return np.bincount(sources[:n], minlength=3) / min(n, len(sources))


@pytest.mark.parametrize("exhausted", ["stop", "cycle"])
def test_3_1_1_holds_60_20_20_and_the_seed_decides_the_order(exhausted: str) -> None:
    counts = [4000, 1500, 1500]
    orders = {seed: mix_order(counts, MixSpec(WEIGHTS, seed=seed, exhausted=exhausted)) for seed in range(8)}
    for order in orders.values():
        assert np.abs(_shares(order.sources) - [0.6, 0.2, 0.2]).max() < 0.03
        for s, n in enumerate(counts):  # each source's rows in their own order, wrapped when cycling
            rows = order.rows[order.sources == s]
            assert (rows == np.arange(len(rows)) % n).all()
    again = mix_order(counts, MixSpec(WEIGHTS, seed=3, exhausted=exhausted))
    assert (again.sources == orders[3].sources).all()
    assert all((orders[0].sources[:2000] != orders[seed].sources[:2000]).any() for seed in range(1, 8))
    if exhausted == "stop":  # ends when the 4000 rows of source 0 run out at their 60% (before the others)
        assert orders[0].counts(3)[0] == 4000 and orders[0].counts(3)[1:].max() < 1500
    else:  # every source read whole at least once; the 4000 rows of source 0 wrap past 60% of 7500
        assert (orders[0].counts(3) >= counts).all() and orders[0].counts(3)[1:].min() >= 1500


@pytest.mark.parametrize("exhausted", ["stop", "cycle"])
def test_the_lazy_stream_is_the_computed_one_and_needs_at_most_the_bound(exhausted: str) -> None:
    rng = np.random.default_rng(1)
    for _ in range(5):
        counts = rng.integers(1, 400, 3).tolist()
        spec = MixSpec(tuple(rng.uniform(0.1, 5, 3)), seed=int(rng.integers(100)), exhausted=exhausted)
        lazy = list(MixStream([lambda n=n: iter(range(n)) for n in counts], spec))
        order = mix_order(counts, spec)
        assert [s for s, _ in lazy] == order.sources.tolist() and [r for _, r in lazy] == order.rows.tolist()
        needed = rows_needed(counts, spec)
        assert all(order.rows[order.sources == s].max() < needed[s] for s in range(3))  # the pipeline's take


def test_three_sources_of_three_formats_mix_60_20_20_as_preview_reads_them(paths) -> None:
    config = load_config(None, mix_overrides(paths))
    rows, _ = preview_rows(config, 2000)
    sources = np.asarray([list(SIZES).index(row.source) for row in rows])
    assert np.abs(_shares(sources) - [0.6, 0.2, 0.2]).max() < 0.03
    assert {row.format for row in rows} == {"messages", "sharegpt", "alpaca"}
    assert all(row.status == "ok" for row in rows)
    first = [row.source for row in preview_rows(config, 40)[0]]
    assert first == [row.source for row in rows[:40]]
    reseeded = load_config(None, mix_overrides(paths, "data.seed=5"))
    other = [row.source for row in preview_rows(reseeded, 40)[0]]
    assert other != first


def _union_blocks(data, size: int = 150) -> list[pa.Table]:
    """The raw blocks the Ray pipeline's one map gets: each source's rows (cut to its take) in blocks, with
    their file in `path` (as include_paths writes it), handed on round-robin as Ray Data's union does."""
    from app.data.readers import iter_local_rows

    per_source = []
    for source in data.sources:
        rows = [row for batch in iter_local_rows(source.data, 4096) for row in batch][: source.take]
        rows = [{"text": row["json_line"]} for row in rows] if source.json_lines else rows  # read_text's
        table = pa.Table.from_pylist(rows)
        table = table.append_column(PATH_COLUMN, pa.array([source.data.files[0]] * len(rows)))
        per_source.append([table.slice(i, size) for i in range(0, len(rows), size)])
    return [blocks[k] for k in range(max(map(len, per_source))) for blocks in per_source if k < len(blocks)]


def test_a_prepared_mix_trains_the_rows_of_the_tokenizing_run(paths, tmp_path: Path) -> None:
    """data prepare's shards (written by the task function, folded by the driver) read back as the planner's
    stream equal the tokenizing run's stream, row for row and source for source; a weight changed since is
    refused at the prepared load, naming the key."""
    raw = load_config(None, mix_overrides(paths))
    data = resolve_data(raw.data, max_length=raw.max_sequence_length)
    assert [s.take for s in data.sources] == [None, 502, 502]  # stop: what 3:1:1 can reach of 700 and 600
    blocks, specs = _union_blocks(data), tuple(source.spec("qwen") for source in data.sources)
    ids = tuple(entry.source_id for entry in raw.data.sources)
    spec = MixSpec(WEIGHTS, seed=raw.data.seed)
    tokenizing = RowTable.from_tables(out for block in blocks for out in tokenize(block, specs, 64))
    expected = stream_rows(tokenizing.source_codes, tokenizing.source_names, ids, spec)

    out = tmp_path / "prepared"
    out.mkdir()
    target = ShardTarget(str(out))
    summaries = [summary for block in blocks for summary in tokenize(block, specs, write=target)]
    record, scan = fold_summaries(data, summaries, max_length=raw.max_sequence_length)
    (out / MANIFEST).write_text(json.dumps(record))
    assert record["sources"] == {"chat": 1500, "share": 502, "alpaca": 502}
    assert scan.sources["chat"]["share"] == 0.6 and scan.num_rows == len(expected)

    prepared = load_config(None, mix_overrides(paths, "data.source=prepared", f"data.path={out}"))
    loaded = resolve_data(prepared.data, max_length=prepared.max_sequence_length)
    shards = RowTable.from_tables(pq.read_table(f) for f in loaded.source.files)
    got = stream_rows(shards.source_codes, shards.source_names, ids, spec)
    assert len(got) == len(expected)
    for position in range(0, len(got), 7):
        want = tokenizing.tokens(int(expected.table_rows[position]))
        have = shards.tokens(int(got.table_rows[position]))
        assert all((x == y).all() for x, y in zip(want, have, strict=True)), position
    assert (got.sources == expected.sources).all()
    previewed = [row["source"] for row in itertools.islice(prepared_rows(loaded.source, prepared.data), 30)]
    assert previewed == [row.source for row in preview_rows(raw, 30)[0]]

    changed = load_config(None, mix_overrides(paths, "data.source=prepared", f"data.path={out}",
                                              "data.sources.1.weight=2"))
    with pytest.raises(DataError, match=r"data\.sources\[1\]\.weight: prepared with 1\.0, this config has "
                                        r"2\.0"):
        resolve_data(changed.data, max_length=changed.max_sequence_length)


def test_a_resume_with_another_weight_is_refused_naming_the_key(paths, tmp_path: Path) -> None:
    config = load_config("configs/tiny-cpu.yaml", mix_overrides(paths))
    write_snapshot(config, tmp_path, template=None)
    (tmp_path / "checkpoint_manager_snapshot.json").write_text(
        json.dumps({"checkpoint_results": [{"metrics": {"step": 2}}]}))
    assert check_resume(config, tmp_path) is True
    for change, message in (("data.sources.2.weight=2", r"data\.sources\[2\]\.weight: 1\.0 -> 2\.0"),
                            ("data.mix_exhausted=cycle", r"data\.mix_exhausted: 'stop' -> 'cycle'"),
                            ("data.sources.0.max_samples=10", r"data\.sources\[0\]\.max_samples: 0 -> 10")):
        with pytest.raises(ConfigError, match=message):
            check_resume(load_config("configs/tiny-cpu.yaml", mix_overrides(paths, change)), tmp_path)


@pytest.mark.parametrize(("override", "message"), [
    ("data.path=x.jsonl", r"data\.sources replaces the top-level source keys, but data\.path is set too"),
    ("data.format_type=alpaca", r"data\.format_type is set too"),
    ("data.sources.1.weight=0", r"data\.sources\[1\]\.weight must be > 0"),
    ("data.sources.1.weight=-1", r"data\.sources\[1\]\.weight must be > 0"),
    ("data.sources.2.id=chat", r"data\.sources\[2\]\.id='chat' is also data\.sources\[0\]'s id"),
    ("data.sources.0.chat_template=chatml", r"data\.sources\[0\]: unknown key 'chat_template'; data\."
                                            r"chat_template is one per run"),
    ("data.sources.0.max_samples=-1", r"data\.sources\[0\]\.max_samples must be >= 0"),
])
def test_bad_mix_settings_are_exit_2_naming_the_key(paths, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, mix_overrides(paths, override))


def test_bad_sources_stop_before_ray_naming_the_source_and_the_key(paths, tmp_path: Path) -> None:
    def resolve(*more: str, which: dict[str, Path] = paths) -> None:
        config = load_config(None, mix_overrides(which, *more))
        resolve_data(config.data, max_length=config.max_sequence_length)

    empty = dict(paths, alpaca=tmp_path / "none.jsonl")
    empty["alpaca"].write_text("")
    with pytest.raises(DataError, match=r"data\.sources\[2\]\.path=.*none\.jsonl' holds no rows"):
        resolve(which=empty)
    with pytest.raises(DataError, match=r"data\.sources\[1\]\.path=.*does not exist \(.*\(source 'share'\)"):
        resolve(which=dict(paths, share=tmp_path / "missing.parquet"))
    with pytest.raises(DataError, match=r"data\.sources\[0\] .*and data\.sources\[1\] .*both read"):
        resolve(which=dict(paths, share=paths["chat"]))
    # the `none` template renders one exchange: a source of multi-turn chats cannot share it
    turns = tmp_path / "turns.jsonl"
    turns.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                 "content": "b"}] * 2}) + "\n")
    with pytest.raises(DataError, match=r"data\.sources\[0\] \('chat'\): data\.chat_template cannot render"):
        resolve("data.chat_template=none", which=dict(paths, chat=turns))
    # a per-message field of a type no row can use: in a JSONL row, and in a Parquet schema
    typo = tmp_path / "typo.jsonl"
    typo.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b", "train": "no"}]}) + "\n")
    with pytest.raises(DataError, match=r"data\.sources\[2\] \('alpaca'\): messages\[1\]\.train is a string"):
        resolve(which=dict(paths, alpaca=typo))
    typed = tmp_path / "typed.parquet"
    turn = {"from": "gpt", "value": "x", "weight": "high"}
    pq.write_table(pa.Table.from_pylist([{"conversations": [turn]}]), typed)
    with pytest.raises(DataError, match=r"data\.sources\[1\]: conversations\[\]\.weight is string in the "
                                        r"file's schema; a per-message weight must be 0 or 1"):
        resolve(which=dict(paths, share=typed))


def _scan(statuses: dict[str, list[str]], config, reasons: dict[str, list[str]] | None = None):
    tally = ScanTally()
    for source, status in statuses.items():
        n = len(status)
        tally.add({"status": np.asarray(status), "reason": np.asarray((reasons or {}).get(source, [""] * n)),
                   "format": np.full(n, "messages"), "source": np.full(n, source),
                   "num_tokens": np.full(n, 5), "raw_tokens": np.full(n, 5), "label_tokens": np.full(n, 2)})
    return tally.scan(config.data, max_length=100)


def test_the_scan_names_a_source_without_usable_rows_and_a_bad_message_field(paths) -> None:
    config = load_config(None, mix_overrides(paths))
    scan = _scan({"chat": ["ok"] * 30, "share": ["ok"] * 10, "alpaca": ["excluded"] * 2 + ["ok"] * 10},
                 config)
    assert scan.sources["chat"]["rows"] == 30 and scan.counts["excluded"] == 2
    assert "sources: chat=30 rows" in scan.summary() and "excluded=2" in scan.summary()
    with pytest.raises(DataError, match=r"data\.sources\[1\] \('share', .*has no usable row \(10 rows: "
                                        r"excluded=10\)"):
        _scan({"chat": ["ok"] * 30, "share": ["excluded"] * 10, "alpaca": ["ok"] * 10}, config)
    reason = "messages[3].weight is 0.5, not 0 or 1 (a per-message weight: 0 leaves the message out of the " \
             "loss)"
    with pytest.raises(DataError, match=r"data\.sources\[2\] \('alpaca'\): messages\[3\]\.weight is 0\.5"):
        _scan({"chat": ["ok"] * 30, "share": ["ok"] * 10, "alpaca": ["ok"] * 9 + ["malformed"]}, config,
              {"alpaca": [""] * 9 + [reason]})


def test_the_planner_stream_does_not_depend_on_how_the_union_interleaved_the_blocks() -> None:
    """Two tables holding the same sources' rows in another block interleave give the same stream."""
    def table(order: list[tuple[str, range]]) -> RowTable:
        return RowTable.from_tables(pa.table({"input_ids": [[i] * 2 for i in rows],
                                              "labels": [[i] * 2 for i in rows], "status": ["ok"] * len(rows),
                                              "source": [name] * len(rows)}) for name, rows in order)

    a = table([("x", range(0, 5)), ("y", range(100, 103)), ("x", range(5, 9)), ("y", range(103, 106))])
    b = table([("y", range(100, 106)), ("x", range(0, 9))])
    spec = MixSpec((2, 1), seed=4, exhausted="cycle")
    sa, sb = (stream_rows(t.source_codes, t.source_names, ("x", "y"), spec) for t in (a, b))
    assert [a.tokens(int(r))[0][0] for r in sa.table_rows] == [b.tokens(int(r))[0][0] for r in sb.table_rows]


def test_ray_data_still_has_the_budget_interval_the_pipeline_shortens() -> None:
    from ray.data._internal.execution.resource_manager import ResourceManager

    from app.data.ray_env import BUDGET_REFRESH_S, apply_executor_settings

    assert hasattr(ResourceManager, "GLOBAL_LIMITS_UPDATE_INTERVAL_S")
    apply_executor_settings()
    assert ResourceManager.GLOBAL_LIMITS_UPDATE_INTERVAL_S <= BUDGET_REFRESH_S
