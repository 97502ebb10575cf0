"""Hardware profiles and cost models from the config tree (the file IO that scheduling/ stays free of)."""

from __future__ import annotations

from pathlib import Path

from app.config import CONFIG_DIR, ConfigError, HardwareConfig, ModelConfig, load_yaml
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
    data = load_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"hardware.profile {path}: expected a mapping of profile fields, got {data!r}")
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


def cost_model_from_config(model: ModelConfig, hardware: HardwareConfig) -> CostModel:
    """The cost model of the model's dimensions (and parameter count) on hardware.profile."""
    hidden, kv_hidden, layers = model_dims(model)
    return CostModel.from_model_dims(hidden_size=hidden, kv_hidden_size=kv_hidden, num_layers=layers,
                                     profile=load_hardware_profile(hardware.profile),
                                     num_params=model.num_params)
