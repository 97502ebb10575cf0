"""Hardware profiles and cost models from the config tree (the file IO that scheduling/ stays free of)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import CONFIG_DIR, ConfigError, HardwareConfig, ModelConfig, SkrullConfig, load_yaml
from scheduling import CostModel, HardwareProfile
from scheduling.cost import CostFormula
from workers.presets import TINY_DEFAULTS, is_tiny_preset

if TYPE_CHECKING:
    from app.data.tokenizer import TextTokenizer

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


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The dimensions the cost model reads (scheduling/cost.py)."""

    hidden_size: int
    kv_hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int


def model_dims(model: ModelConfig, tokenizer: str | TextTokenizer = "qwen") -> ModelDims:
    """The cost model's dimensions: from the config where set, else from the model.

    A tiny preset's come from its defaults (overridden by the config's fields; its vocabulary is the
    tokenizer's, as the workers build it), a local directory's or hub id's from its HF config. They only
    steer the plan's balance: a wrong value never changes the math of a step.
    """
    given = (model.hidden_size, model.kv_hidden_size, model.num_layers)
    if all(given) and model.intermediate_size and model.vocab_size:
        return ModelDims(*given, model.intermediate_size, model.vocab_size)
    if is_tiny_preset(model.name_or_path):
        return _tiny_dims(model, tokenizer)
    if all(given):  # enough for the paper formula; the model formula falls back to 4h and Qwen's V
        return ModelDims(*given, model.intermediate_size, model.vocab_size)
    return _hf_dims(model)


def _tiny_dims(model: ModelConfig, tokenizer: str | TextTokenizer) -> ModelDims:
    hidden = model.hidden_size or TINY_DEFAULTS["hidden_size"]
    heads = model.num_attention_heads or TINY_DEFAULTS["num_attention_heads"]
    kv_heads = model.num_key_value_heads or TINY_DEFAULTS["num_key_value_heads"]
    vocab = model.vocab_size
    if not vocab:
        from app.data.tokenizer import vocab_size_of

        vocab = vocab_size_of(tokenizer)
    return ModelDims(hidden, model.kv_hidden_size or kv_heads * (hidden // heads),
                     model.num_layers or TINY_DEFAULTS["num_layers"],
                     model.intermediate_size or TINY_DEFAULTS["intermediate_size"], vocab)


def _hf_dims(model: ModelConfig) -> ModelDims:
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model.name_or_path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"the cost model needs the model's dimensions and model.name_or_path={model.name_or_path!r} has "
            f"no readable config ({type(err).__name__}); set model.hidden_size, model.kv_hidden_size, "
            "model.num_layers, model.intermediate_size and model.vocab_size (e.g. Qwen2.5-0.5B: 896, 128, "
            "24, 4864, 151936)"
        ) from None
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return ModelDims(model.hidden_size or hf.hidden_size, model.kv_hidden_size or kv_heads * head_dim,
                     model.num_layers or hf.num_hidden_layers,
                     model.intermediate_size or getattr(hf, "intermediate_size", 0),
                     model.vocab_size or hf.vocab_size)


def cost_model_from_config(model: ModelConfig, hardware: HardwareConfig, *, formula: CostFormula = "paper",
                           tokenizer: str | TextTokenizer = "qwen") -> CostModel:
    """The cost model (scheduling.cost_formula) of the model's dimensions on hardware.profile.

    The paper formula reads h, h_kv and L only, so it never loads the tokenizer for a tiny preset's
    vocabulary (its parameter estimate keeps Qwen's vocabulary unless model.vocab_size is set).
    """
    if formula == "model":
        dims = model_dims(model, tokenizer)
    else:
        dims = model_dims(dataclasses.replace(model, vocab_size=model.vocab_size or 1), tokenizer)
        dims = dataclasses.replace(dims, intermediate_size=0, vocab_size=model.vocab_size)
    return CostModel.from_model_dims(
        hidden_size=dims.hidden_size, kv_hidden_size=dims.kv_hidden_size, num_layers=dims.num_layers,
        profile=load_hardware_profile(hardware.profile), num_params=model.num_params, formula=formula,
        intermediate_size=dims.intermediate_size, vocab_size=dims.vocab_size)


def cost_model(config: SkrullConfig, *, tokenizer: TextTokenizer | None = None) -> CostModel:
    """The run's cost model: scheduling.cost_formula over the model's dimensions and hardware.profile;
    `tokenizer`: the run's loaded one (else data.tokenizer is loaded when a tiny preset needs its size)."""
    return cost_model_from_config(config.model, config.hardware, formula=config.scheduling.cost_formula,
                                  tokenizer=tokenizer or config.data.tokenizer)
