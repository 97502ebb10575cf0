"""Hardware profiles and cost models from the config tree (the file IO that scheduling/ stays free of)."""

from __future__ import annotations

from pathlib import Path

import yaml

from app.config import CONFIG_DIR, ConfigError, ModelConfig, SkrullConfig
from scheduling import CostModel, HardwareProfile
from workers.presets import TINY_DEFAULTS, is_tiny_preset

HARDWARE_DIR = CONFIG_DIR / "hardware"


def load_hardware_profile(name_or_path: str) -> HardwareProfile:
    """A profile by name (configs/hardware/<name>.yaml) or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
        raise ConfigError(f"hardware.profile={name_or_path!r}: no such profile (known: {known}, or a path)")
    data = yaml.safe_load(path.read_text()) or {}
    try:
        return HardwareProfile.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"hardware.profile {path}: {err}") from None


def model_dims(model: ModelConfig) -> tuple[int, int, int]:
    """(hidden_size, kv_hidden_size, num_layers): from the config when all are set, else from the model.

    A tiny preset's dimensions come from its defaults (overridden by the config's tiny-preset fields), a
    local directory's or hub id's from its HF config. They only steer the plan's balance: a wrong value
    never changes the math of a step.
    """
    if model.hidden_size and model.kv_hidden_size and model.num_layers:
        return model.hidden_size, model.kv_hidden_size, model.num_layers
    if is_tiny_preset(model.name_or_path):
        hidden = model.hidden_size or TINY_DEFAULTS["hidden_size"]
        heads = model.num_attention_heads or TINY_DEFAULTS["num_attention_heads"]
        kv_heads = model.num_key_value_heads or TINY_DEFAULTS["num_key_value_heads"]
        return hidden, kv_heads * (hidden // heads), model.num_layers or TINY_DEFAULTS["num_layers"]
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model.name_or_path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"the cost model needs the model's dimensions and model.name_or_path={model.name_or_path!r} has "
            f"no readable config ({type(err).__name__}); set model.hidden_size, model.kv_hidden_size and "
            "model.num_layers (e.g. Qwen2.5-0.5B: 896, 128, 24)"
        ) from None
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return hf.hidden_size, kv_heads * head_dim, hf.num_hidden_layers


def model_num_params(model: ModelConfig) -> int:
    """model.num_params, or 0 to let CostModel.params estimate it from the dims (documented there).

    Reading a hub model's weights just to count them would defeat a dry run, so the paper configs state
    Qwen2.5's counts; tiny presets use the estimate (their Qwen-vocabulary embeddings dominate it).
    """
    if model.num_params < 0:
        raise ConfigError(f"model.num_params must be >= 0, got {model.num_params}")
    return model.num_params


def cost_model_from_config(config: SkrullConfig) -> CostModel:
    """The cost model of config.model's dimensions (and parameter count) on config.hardware.profile."""
    hidden, kv_hidden, layers = model_dims(config.model)
    return CostModel.from_model_dims(hidden_size=hidden, kv_hidden_size=kv_hidden, num_layers=layers,
                                     profile=load_hardware_profile(config.hardware.profile),
                                     num_params=model_num_params(config.model))
