"""ray_cluster.yaml passes Ray's own cluster-launcher validation; the GPU run configs (and every YAML in
configs/) load strictly; a GPU run in fp32 is refused before Ray starts."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import CONFIG_DIR, REPO_ROOT, load_config
from app.profiling.hardware import load_hardware_profile


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` does before launching: fill in the provider defaults, then check against the schema.

    Ray has no public validator for cluster-launcher files; these two functions are exactly what `ray up`
    runs on the file, so the test uses them rather than a copy of Ray's schema.
    """
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return yaml.safe_load((REPO_ROOT / "ray_cluster.yaml").read_text())


def test_cluster_yaml_is_valid(cluster: dict[str, Any]) -> None:
    prepared = validate(cluster)
    gpu = prepared["available_node_types"]["gpu_h100"]
    assert gpu["min_workers"] <= gpu["max_workers"] <= prepared["max_workers"]
    assert prepared["head_node_type"] == "head"
    assert any("pip install" in c and ".[gpu]" in c for c in prepared["setup_commands"])
    assert "." in prepared["file_mounts"].values()


def _broken(cluster: dict[str, Any], edit) -> dict[str, Any]:
    broken = copy.deepcopy(cluster)
    edit(broken)
    return broken


@pytest.mark.parametrize("edit", [
    lambda c: c["available_node_types"]["gpu_h100"].update(min_wokers=1),       # misspelled key
    lambda c: c.update(head_node_type="no-such-node-type"),
    lambda c: c["available_node_types"]["gpu_h100"].update(max_workers="four"),  # wrong type
    lambda c: c.update(max_workers=0) or c["available_node_types"]["gpu_h100"].update(min_workers=1),
], ids=["unknown-key", "bad-head-type", "wrong-type", "min-over-max"])
def test_broken_variants_are_rejected(cluster: dict[str, Any], edit) -> None:
    import jsonschema

    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate(_broken(cluster, edit))


@pytest.mark.parametrize(("path", "model", "bucket"), [
    ("configs/qwen2.5-0.5b-gpu.yaml", "Qwen/Qwen2.5-0.5B", "auto"),
    ("configs/qwen2.5-7b-gpu.yaml", "Qwen/Qwen2.5-7B", "auto"),
])
def test_gpu_configs_load(path: str, model: str, bucket: int | str) -> None:
    cfg = load_config(REPO_ROOT / path)
    assert cfg.model.name_or_path == model and cfg.model.dtype == "bf16"
    assert cfg.parallel.cp_size == 8 and cfg.parallel.worker_range == (8, 32)  # elastic: 1-4 nodes of 8
    assert cfg.scheduling.bucket_size == bucket and cfg.hardware.profile == "h100"
    assert cfg.resources.gpus_per_worker == 1
    assert cfg.data.source == "path" and cfg.data.path
    # dimensions only for `plan` offline (model.offline_dims); the model's own config.json otherwise
    assert cfg.model.hidden_size == 0 and min(cfg.model.offline_dims[k] for k in (
        "hidden_size", "kv_hidden_size", "num_layers")) > 0


@pytest.mark.parametrize(("path", "model", "bucket"), [
    ("configs/qwen2.5-0.5b-gpu-1node.yaml", "Qwen/Qwen2.5-0.5B", "auto"),
    ("configs/qwen2.5-7b-gpu-1node.yaml", "Qwen/Qwen2.5-7B", "auto"),
])
def test_single_node_gpu_configs_load(path: str, model: str, bucket: int | str) -> None:
    """One node of 8 GPUs: DP 1 x CP 8, bf16, PyTorch's flash kernel (no flash-attn build), and paths that
    do not resolve inside `ray job submit --working-dir`'s temporary copy of the checkout."""
    cfg = load_config(REPO_ROOT / path)
    assert cfg.model.name_or_path == model and cfg.model.dtype == "bf16"
    assert cfg.model.attention_backend == "torch-flash"
    assert cfg.parallel.worker_range == (8, 8) and cfg.parallel.cp_size == 8 and cfg.parallel.dp_size == 1
    assert cfg.scheduling.bucket_size == bucket and cfg.resources.gpus_per_worker == 1
    for where in (cfg.run.storage_path, cfg.data.path):
        assert Path(where).is_absolute() or "://" in where, where


def test_every_yaml_in_configs_loads() -> None:
    """Run configs through load_config, hardware profiles through their own strict loader."""
    paths = sorted(CONFIG_DIR.rglob("*.yaml"))
    assert len(paths) >= 10
    for path in paths:
        if path.parent.name == "hardware":
            assert load_hardware_profile(str(path)).name == path.stem
        else:
            load_config(path)


def test_a_gpu_run_in_fp32_is_exit_2_naming_model_dtype_before_ray() -> None:
    """Both CUDA kernels refuse fp32; without this rule the run failed at the first attention call, after
    Ray, the data pipeline, the model and the engine were up. The real CLI, in a process of its own."""
    result = subprocess.run(
        [sys.executable, "-m", "app", "train", "--config", "configs/tiny-cpu.yaml",
         "--set", "resources.gpus_per_worker=1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "model.dtype=fp32 with resources.gpus_per_worker=1" in result.stderr
    assert "model.dtype=bf16" in result.stderr  # the fix, named
    assert "Started a local Ray instance" not in result.stdout + result.stderr
    ok = load_config("configs/tiny-cpu.yaml", ["model.dtype=bf16", "resources.gpus_per_worker=1"])
    assert ok.model.dtype == "bf16" and ok.resources.gpus_per_worker == 1
