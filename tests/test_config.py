"""The config tree: strict YAML, self-validating frozen sections, one policy list, strict profiles."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from app.config import ConfigError, SchedulingConfig, SkrullConfig, load_config
from app.profiling.hardware import load_hardware_profile
from scheduling import POLICIES


def test_sections_are_frozen_and_keyword_only() -> None:
    config = load_config("configs/tiny-cpu.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.name_or_path = "tiny-llama"  # type: ignore[misc]
    with pytest.raises(TypeError):
        SchedulingConfig("skrull")  # type: ignore[misc]


@pytest.mark.parametrize("override, message", [
    ("model.dtype=fp16", "model.dtype='fp16' is not one of: fp32, bf16"),
    ("model.attention_backend=xformers", "model.attention_backend='xformers' is not one of"),
    ("data.too_long=cut", "data.too_long='cut' is not one of: error, truncate, drop"),
    ("scheduling.policy=fastest", "scheduling.policy='fastest' is not one of: " + ", ".join(POLICIES)),
    ("scheduling.prefetch=0", "scheduling.prefetch must be >= 1"),
    ("train.log_every=0", "train.log_every must be >= 1"),
    ("resources.cpus_per_worker=-1", "resources.cpus_per_worker must be >= 0"),
    ("parallel.backend=nccl", "parallel.backend=nccl needs GPUs"),
    ("model.attention_backend=flash", "model.attention_backend=flash runs on CUDA only"),
    ("resources.gpus_per_worker=1", "model.dtype=fp32 with resources.gpus_per_worker=1: the CUDA attention "
                                    "kernels take bf16 only"),
    ("scheduling.global_batch_size=1", "smaller than the DP size"),
    ("parallel.num_workers=[2, 3]", "parallel.num_workers=3 is not divisible by parallel.cp_size=2"),
    ("parallel.num_workers=[4, 2]", "parallel.num_workers=[4, 2]: min must be <= max"),
    ("parallel.num_workers=[2]", "parallel.num_workers: expected int or a list of 2 values, got [2]"),
    ("parallel.resize_check_s=-1", "parallel.resize_check_s must be >= 0"),
    ("train.max_failures=-2", "train.max_failures must be >= 0 (or -1: no limit)"),
    ("train.collective_timeout_s=0", "train.collective_timeout_s must be > 0"),
    ("scheduling.planner_timeout_s=0", "scheduling.planner_timeout_s must be > 0"),
    ("resources.worker_resources={GPU: 1}", "resources.worker_resources.GPU=1.0: custom resources only"),
    ("resources.worker_resources={slot: x}", "resources.worker_resources.slot: expected float"),
    ("train.lr=2e-5x", "train.lr: expected float, got '2e-5x'"),
    ("train.lr_scheduler=step", "train.lr_scheduler='step' is not one of: constant, linear, cosine"),
    ("train.warmup_ratio=1", "train.warmup_ratio must be in [0, 1)"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be in [0, 1]"),
    ("train.adam_betas=[0.9, 1]", "train.adam_betas must be two numbers in [0, 1)"),
    ("train.adam_betas=0.9", "train.adam_betas: expected a list of 2 values"),
    ("train.adam_eps=0", "train.adam_eps must be > 0"),
    ("train.wandb_project=team/project", "train.wandb_project must be a name without '/'"),
])
def test_every_section_checks_its_own_fields(override: str, message: str) -> None:
    overrides = [override, "parallel.cp_size=1"] if "global_batch_size" in override else [override]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny-cpu.yaml", overrides)


def test_warmup_is_steps_or_a_ratio_not_both() -> None:
    with pytest.raises(ConfigError, match=r"train.warmup_steps and train.warmup_ratio are both set"):
        load_config(None, ["train.warmup_steps=10", "train.warmup_ratio=0.1"])
    assert load_config(None, ["train.warmup_ratio=0.03"]).train.warmup_ratio == 0.03


@pytest.mark.parametrize("written, value", [
    ("2e-5", 2e-5), ("1e30", 1e30), ("1.0e30", 1e30), (".5", 0.5), ("1E-3", 1e-3), ("+3E+2", 300.0),
    ("2.0e-5", 2e-5), ("1.0e+30", 1e30), ("3", 3.0), ("1_000", 1000.0), ("0x10", 16.0),
])
def test_floats_as_users_write_them(tmp_path: Path, written: str, value: float) -> None:
    """YAML 1.2 floats where a float is expected, in a file and in --set alike; YAML 1.1 ints (`1_000`,
    `0x10`) keep their meaning."""
    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  weight_decay: 0\n  grad_clip: {written}\n")
    from_file = load_config(path).train.grad_clip
    from_set = load_config(None, [f"train.grad_clip={written}"]).train.grad_clip
    assert from_file == from_set == value and isinstance(from_file, float) and isinstance(from_set, float)
    betas = load_config(None, [f"train.adam_betas=[0.5, {written}]"]).train.adam_betas if 0 <= value < 1 \
        else (0.5, value)
    assert betas == (0.5, value)
    with pytest.raises(ConfigError, match=re.escape("train.grad_clip must be >= 0, got -0.001")):
        load_config(None, ["train.grad_clip=-1E-3"])  # a negative one is the number, checked as such


@pytest.mark.parametrize("written", ["2e-5", "1e30", "-1E-3", "1e5"])
def test_a_string_field_keeps_a_number_like_text_as_written(written: str) -> None:
    assert load_config(None, [f"run.name={written}"]).run.name == written
    assert load_config(None, [f"model.name_or_path={written}"]).model.name_or_path == written


def test_every_policy_of_the_registry_is_a_valid_config() -> None:
    for policy in POLICIES:
        assert load_config(None, [f"scheduling.policy={policy}"]).scheduling.policy == policy


def test_an_elastic_worker_range_maps_to_min_max() -> None:
    fixed = load_config("configs/tiny-cpu.yaml").parallel
    assert fixed.worker_range == (2, 2) and not fixed.elastic
    elastic = load_config("configs/tiny-cpu.yaml", ["parallel.num_workers=[2, 6]"]).parallel
    assert elastic.num_workers == (2, 6) and elastic.elastic and elastic.dp_size == 3  # DP at the maximum


def test_derived_values_and_defaults() -> None:
    config = SkrullConfig()
    assert config.max_sequence_length == config.scheduling.bucket_size * config.parallel.cp_size
    capped = load_config(None, ["data.max_length=100"])
    assert capped.max_sequence_length == 100


def test_hardware_profiles_load_strictly(tmp_path: Path) -> None:
    assert load_hardware_profile("cpu").name == "cpu"
    duplicated = tmp_path / "dup.yaml"
    duplicated.write_text("name: x\nmfu: 0.3\nmfu: 0.4\n")
    with pytest.raises(ConfigError, match="duplicate key 'mfu'"):
        load_hardware_profile(str(duplicated))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("name: x\nmfu_typo: 0.3\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_hardware_profile(str(unknown))
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [x\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_hardware_profile(str(broken))


def test_a_word_yaml_reads_as_a_boolean_is_the_word_where_a_choice_is_meant(tmp_path: Path) -> None:
    """`calibration: off` is YAML 1.1's false to PyYAML: a Literal field of words takes the word."""
    path = tmp_path / "run.yaml"
    path.write_text("scheduling:\n  calibration: off\n")
    assert load_config(path).scheduling.calibration == "off"
    assert load_config(None, ["scheduling.calibration=off"]).scheduling.calibration == "off"
    with pytest.raises(ConfigError, match="scheduling.calibration=True is not one of: online, off"):
        load_config(None, ["scheduling.calibration=yes"])


def test_an_error_names_the_override_that_brings_it_in_not_an_earlier_passing_one() -> None:
    """num_workers=1 fails alone against the file's cp_size=8, and cp_size=1 fixes it: the error the user
    sees is the torch backend on GPU workers, attributed to the override that asked for it."""
    overrides = ["data.source=synthetic", "parallel.num_workers=1", "parallel.cp_size=1",
                 "model.attention_backend=torch"]
    with pytest.raises(ConfigError) as raised:
        load_config("configs/qwen2.5-0.5b-gpu.yaml", overrides)
    assert str(raised.value).startswith("--set model.attention_backend=torch: model.attention_backend=torch "
                                        "runs on CPU only")
    with pytest.raises(ConfigError, match=re.escape("--set parallel.num_workers=3: parallel.num_workers=3 is "
                                                    "not divisible by parallel.cp_size=2")):
        load_config("configs/tiny-cpu.yaml", ["parallel.num_workers=3"])
