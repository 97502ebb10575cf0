"""`python -m app config show`: the config a run would use, loadable again, with BucketSize and every other
auto value known without a GPU resolved (app/train/resolved_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from app.__main__ import main
from app.config import load_config
from app.profiling.budget import resolve_bucket_size

GPU_CONFIG = "configs/qwen2.5-0.5b-gpu.yaml"
LATENCY = ("plan_ms", "two_level_plan_ms")
"""Plan keys that time the planner (they differ between any two runs)."""


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _modeled(plan: dict) -> dict:
    """plan --json without what times the planner or says where C and the checkpointing came from (the
    shown config has both written down: the same setting, no longer chosen)."""
    def strip(value: object) -> object:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not k.startswith(LATENCY)}
        return value
    kept = {k: strip(v) for k, v in plan.items() if k not in ("bucket_size_source", "checkpointing")}
    return kept | {"checkpointing": plan["checkpointing"]["setting"]}


def test_the_gpu_config_shows_bucket_size_from_memory_and_plans_the_same_loaded_back(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    shown = _run(capsys, "config", "show", "--config", GPU_CONFIG)
    # data/lmsys is the user's to make: checkpointing=auto models steps over synthetic lengths, and says so
    _, budget = resolve_bucket_size(load_config(GPU_CONFIG, ["data.source=synthetic"]))
    assert "because the data cannot be read here (data.path='data/lmsys' does not exist" in shown
    assert "activation_checkpointing: false  # auto -> memory" in shown  # off fits 80 GB at 43k tokens
    assert budget.source == "memory" and budget.tokens > 0
    assert f"  bucket_size: {budget.tokens}  # auto -> memory\n" in shown
    assert f"scheduling.bucket_size = {budget.tokens} (memory): {budget.line()}" in shown
    assert "  cp_degrees: [1, 2, 4, 8]  # auto -> config\n" in shown
    assert "  chat_template: chatml  # auto -> tokenizer\n" in shown and "  backend: nccl  # auto" in shown
    assert "tokenize_concurrency: auto  # not resolved" in shown  # 32 workers x 8 CPUs: not this machine's

    path = tmp_path / "shown.yaml"
    path.write_text(shown)
    again = load_config(path)
    assert again.scheduling.bucket_size == budget.tokens and again.cp_degrees == (1, 2, 4, 8)
    synthetic = ("--set", "data.source=synthetic")  # data/lmsys is the user's to make: plan sampled lengths
    original = json.loads(_run(capsys, "plan", "--config", GPU_CONFIG, *synthetic, "--json"))
    loaded = json.loads(_run(capsys, "plan", "--config", str(path), *synthetic, "--json"))
    assert (original["bucket_size_source"], loaded["bucket_size_source"]) == ("memory", "config")
    assert _modeled(loaded) == _modeled(original)


def test_show_of_the_tiny_config_resolves_this_machine_and_is_a_fixed_point(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    data = json.loads(_run(capsys, "config", "show", "--config", "configs/tiny-cpu.yaml", "--json"))
    resolved = data["resolved"]
    # an embedded Ray of 6 + 2 CPUs; (8 - 2 workers x 0.5) / 0.5 per task = 14 tasks, capped at 6 cores
    assert resolved["resources.num_cpus"]["value"] == 8
    assert resolved["data.tokenize_concurrency"]["value"] == 6
    assert resolved["data.tokenizer"] == {"setting": "auto", "value": "qwen", "source": "model",
                                          "why": resolved["data.tokenizer"]["why"]}
    assert resolved["scheduling.bucket_size"]["source"] == "config"
    assert resolved["model.attention_backend"]["value"] == "torch"
    assert resolved["run.name"]["source"] == "not resolved"
    assert data["derived"] == {"workers": [2, 2], "dp_size": [1, 1], "cp_size": 2,
                               "max_sequence_length": 1024}

    first = tmp_path / "first.json"
    first.write_text(json.dumps(data["config"]))  # JSON is YAML: --config reads it
    again = json.loads(_run(capsys, "config", "show", "--config", str(first), "--json"))
    assert again["config"] == data["config"]
    assert all(r["setting"] == r["value"] for r in again["resolved"].values())  # nothing left to resolve


def test_machine_values_stay_auto_on_a_cluster(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # never contacted: show starts no Ray
    shown = _run(capsys, "config", "show", "--config", "configs/tiny-cpu.yaml",
                 "--set", "data.chat_template=none")
    tree = yaml.safe_load(shown)
    assert tree["data"]["tokenize_concurrency"] == "auto" and tree["resources"]["num_cpus"] == 0
    assert tree["data"]["chat_template"] == "none"
    assert "RAY_ADDRESS is set" in shown
    assert shown.startswith("# python -m app config show --config configs/tiny-cpu.yaml "
                            "--set data.chat_template=none: ")


def test_a_bad_override_is_exit_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["config", "show", "--config", "configs/tiny-cpu.yaml", "--set", "scheduling.bucket_size=0"]
    assert main(argv) == 2
    assert "scheduling.bucket_size" in capsys.readouterr().err
