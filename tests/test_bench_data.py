"""`bench data` without Ray: the `datasets` variant runs the pipeline's own tokenize function, the summary's
rates and ratios, and the check that every variant tokenized the same rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest

from app.bench.data import Measured, _measured, datasets_map, summarize
from app.config import load_config
from app.data import ray_ops
from app.data.resolved import resolve_data
from tests.data_rows import example_rows


def test_datasets_map_gives_the_rows_of_the_pipelines_tokenize(tmp_path) -> None:
    """The peer variant (two processes) on a JSONL file: the rows TokenizeBatch makes of the same lines."""
    lines = [json.dumps(row) for row in example_rows()]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = load_config(None, ["data.source=path", f"data.path={path}", "data.max_malformed_fraction=1",
                                "scheduling.bucket_size=64", "parallel.cp_size=1", "data.too_long=truncate"])
    data = resolve_data(config.data, max_length=config.max_sequence_length)
    (source,) = data.sources
    peer = datasets_map(((str(path), "jsonl", source.spec("qwen"), None),), 4, 2,
                        cache_dir=str(tmp_path / "cache"))
    direct = ray_ops.TokenizeBatch(*source.spec("qwen")[:4])(pa.table({"text": lines}))
    assert peer == _measured(peer.seconds, direct.to_batches(max_chunksize=5))  # batching does not matter
    assert peer.rows == len(lines) and "truncated" in direct.column("status").to_pylist()


def test_summary_rates_ratios_and_the_same_rows_check() -> None:
    seconds = {"ray_1_task": [10.0, 12.0, 11.0], "ray_all_cpus": [6.0, 5.0, 5.5],
               "datasets_map": [5.0, 5.5, 6.5]}
    results = {name: [Measured(s, 1000, 50_000, "d") for s in runs] for name, runs in seconds.items()}
    summary = summarize(results, cpus=2, rounds=3)
    assert summary["rows_per_s"] == pytest.approx({"ray_1_task": 1000 / 11.0, "ray_all_cpus": 1000 / 5.5,
                                                   "datasets_map": 1000 / 5.5}, abs=0.05)
    assert summary["speedup_vs_one_task"] == 2.0 and summary["speedup_vs_datasets_map"] == 1.0
    assert summary["tokens_per_s"]["ray_1_task"] == pytest.approx(50_000 / 11.0, abs=0.1)
    results["datasets_map"][1] = Measured(5.5, 1000, 50_000, "other")
    with pytest.raises(RuntimeError, match="different rows"):
        summarize(results, cpus=2, rounds=3)


def test_the_bench_command_imports_no_ray_until_it_runs() -> None:
    code = ("import sys; from app.__main__ import build_command_parser; build_command_parser('bench')"
            ".parse_args(['data', '--config', 'x']); print(sorted({'ray', 'datasets', 'torch'} & "
            "set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
