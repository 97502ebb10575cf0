"""`plan` and `bench planner` commands, run in-process through their own argument parsers."""

from __future__ import annotations

import argparse
import json

import pytest

from app.commands import bench, plan
from app.config import ConfigError
from scheduling import POLICIES

PAPER = "configs/paper/qwen2.5-0.5b-lmsys.yaml"
KEYS = {"modeled_step_s", "speedup_vs_static_cp", "speedup_vs_sorted", "bound_ratio", "dp_imbalance",
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
    with pytest.raises(ConfigError, match="model.hidden_size"):
        # a local path that does not exist: the HF config lookup fails at once instead of going online
        _run(plan, ["--config", PAPER, "--set", "model.hidden_size=0", "--set",
                    "model.name_or_path=/nonexistent/skrull-model"])


def test_plan_too_long_is_an_error_naming_the_knobs():
    with pytest.raises(ConfigError, match="data.too_long"):
        _run(plan, ["--config", PAPER, "--set", "data.too_long=error", "--set", "data.max_length=2000"])


def test_bench_planner_json(capsys):
    assert _run(bench, ["planner", "--json", "--repeats", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)["planner"]
    assert [(r["sequences"], r["ranks"]) for r in rows] == list(bench.CASES)
    assert all(r["plan_ms_median"] > 0 for r in rows)
