"""ray_cluster.yaml passes Ray's own cluster-launcher validation; the GPU run configs load strictly."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from app.config import REPO_ROOT, load_config


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
    ("configs/qwen2.5-0.5b-gpu.yaml", "Qwen/Qwen2.5-0.5B", 26000),
    ("configs/qwen2.5-7b-gpu.yaml", "Qwen/Qwen2.5-7B", 13000),
])
def test_gpu_configs_load(path: str, model: str, bucket: int) -> None:
    cfg = load_config(REPO_ROOT / path)
    assert cfg.model.name_or_path == model and cfg.model.dtype == "bf16"
    assert cfg.parallel.cp_size == 8 and cfg.parallel.worker_range == (8, 32)  # elastic: 1-4 nodes of 8
    assert cfg.scheduling.bucket_size == bucket and cfg.hardware.profile == "h100"
    assert cfg.resources.gpus_per_worker == 1
    assert cfg.data.source == "path" and cfg.data.path
    assert min(cfg.model.hidden_size, cfg.model.kv_hidden_size, cfg.model.num_layers) > 0
