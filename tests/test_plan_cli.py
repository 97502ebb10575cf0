"""`plan` and `bench planner` commands, run in-process through their own argument parsers."""

from __future__ import annotations

import argparse
import json

import pytest

from app.commands import bench, plan
from app.config import ConfigError
from scheduling import POLICIES

PAPER = "configs/paper/qwen2.5-0.5b-lmsys.yaml"
KEYS = {"modeled_step_s", "speedup_vs_balanced_packed", "speedup_vs_static_cp", "speedup_vs_sorted",
        "bound_ratio", "dp_imbalance",
        "cp_imbalance", "distributed_token_fraction", "plan_ms_median", "plan_ms_p99", "bound_ratio_median",
        "bound_ratio_feasible"}


def _run(module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


def test_plan_json_on_a_paper_config(capsys, tmp_path):
    png = tmp_path / "ranks.png"
    assert _run(plan, ["--config", PAPER, "--set", "plan.num_batches=2", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == set(POLICIES)
    assert all(set(row) >= KEYS for row in out["policies"].values())
    assert out["policies"]["static_cp"]["speedup_vs_static_cp"] == pytest.approx(1.0)
    assert out["policies"]["skrull"]["speedup_vs_static_cp"] > 1
    for row in out["policies"].values():  # the feasible bound is tighter, and both are lower bounds
        assert 1 - 1e-9 <= row["bound_ratio_feasible"] <= row["bound_ratio"] + 1e-12
        assert row["bound_ratio_median"] >= 1 - 1e-9
    assert png.stat().st_size > 0


def test_plan_table(capsys):
    assert _run(plan, ["--config", PAPER, "--set", "plan.num_batches=1"]) == 0
    text = capsys.readouterr().out
    assert "modeled" in text and all(p in text for p in POLICIES)


def test_plan_needs_model_dims():
    with pytest.raises(ConfigError, match="model.offline_dims"):
        # a local path that does not exist: no config.json to read, and no dimensions in the config
        _run(plan, ["--config", PAPER, "--set", "model.offline_dims={}", "--set",
                    "model.name_or_path=/nonexistent/skrull-model"])


def test_plan_too_long_is_an_error_naming_the_knobs():
    with pytest.raises(ConfigError, match="data.too_long"):
        _run(plan, ["--config", PAPER, "--set", "data.too_long=error", "--set", "data.max_length=2000"])


def test_bench_planner_json(capsys):
    assert _run(bench, ["planner", "--json", "--repeats", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)["planner"]
    assert [(r["sequences"], r["ranks"]) for r in rows] == list(bench.CASES)
    assert all(r["plan_ms_median"] > 0 for r in rows)


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_plan_says_how_many_rows_too_long_changed(capsys, mode: str):
    from app.config import load_config
    from app.profiling.plan_report import sample_batches

    argv = ["--config", PAPER, "--set", "plan.num_batches=1", "--set", "data.max_length=2000",
            "--set", f"data.too_long={mode}"]
    assert _run(plan, [*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"policies", "too_long", "data", "cp_degrees", "bucket_size", "bucket_size_source",
                        "checkpointing", "memory", "memory_terms", "model_dims"}
    assert set(out["policies"]) == set(POLICIES)
    report = out["too_long"]
    assert out["data"]["formats"] == {"synthetic": report["sampled"]}
    assert report["mode"] == mode and report["limit"] == 2000 and 0 < report["rows"] < report["sampled"]
    # The count is the sampled sequences over the limit (the synthetic source draws 2x for drop only).
    config = load_config(PAPER, ["plan.num_batches=1", "data.max_length=2000", f"data.too_long={mode}"])
    batches, too_long = sample_batches(config)
    size = config.scheduling.global_batch_size
    assert too_long.as_json() == report and report["sampled"] == (2 if mode == "drop" else 1) * size
    assert max(int(b.max()) for b in batches) <= 2000
    assert _run(plan, argv) == 0
    text = capsys.readouterr().out
    line = (f"data.too_long=truncate: {report['rows']} of {size} sampled sequences cut to 2000 tokens "
            "(data.truncate_side=left)" if mode == "truncate" else
            f"data.too_long=drop: {report['rows']} of {2 * size} sampled sequences dropped (longer than "
            "2000 tokens)")
    assert line in text.splitlines()


def test_plan_json_reports_an_unchanged_sample(capsys):
    assert _run(plan, ["--config", PAPER, "--set", "plan.num_batches=1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The paper config truncates at bucket_size * cp_size = 208,000 tokens: no LMSYS-like row is that long.
    assert out["too_long"] == {"mode": "truncate", "rows": 0, "limit": 26000 * 8, "sampled": 256}
    assert _run(plan, ["--config", PAPER, "--set", "plan.num_batches=1"]) == 0
    assert "data.too_long=truncate: 0 of 256 sampled sequences cut" in capsys.readouterr().out


def test_apply_too_long_returns_the_rows_it_changed():
    import numpy as np

    from app.config import load_config
    from app.profiling.plan_report import apply_too_long

    lengths = np.array([5, 50, 10, 99, 7])
    for mode, expected in (("truncate", [5, 10, 10, 10, 7]), ("drop", [5, 10, 7])):
        config = load_config(None, ["data.max_length=10", f"data.too_long={mode}"])
        kept, changed = apply_too_long(lengths, config)
        assert kept.tolist() == expected and changed == 2
    assert apply_too_long(lengths, load_config(None, ["data.max_length=100"]))[1] == 0


def test_plan_json_says_which_row_format_read_each_file(capsys, tmp_path):
    from tests.chat_fixtures import build_llama3_tokenizer, write_format_files

    files = write_format_files(tmp_path / "data")
    tokenizer = build_llama3_tokenizer(tmp_path / "tokenizer")  # renders tool calls (ChatML cannot)
    argv = ["--config", PAPER, "--set", "data.source=path", "--set", f"data.path={tmp_path / 'data'}",
            "--set", f"data.tokenizer={tokenizer}",
            "--set", "scheduling.global_batch_size=4", "--set", "plan.num_batches=4", "--json"]
    assert _run(plan, argv) == 0
    data = json.loads(capsys.readouterr().out)["data"]
    assert data["rows"] == data["usable_rows"] == 4 * len(files)
    assert data["formats"] == {"sharegpt": 4, "alpaca": 4, "messages": 4, "prompt_completion": 4}
    assert data["malformed"]["count"] == 0
