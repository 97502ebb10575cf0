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
    num_params: int = 0
    """0: the cost model estimates it from the other dimensions (CostModel.params)."""


def model_dims(model: ModelConfig, tokenizer: str | TextTokenizer = "qwen") -> ModelDims:
    """The cost model's dimensions: the model's own config.json's, checked against the config's model.*
    values (app/model/dims.py: a contradiction is a ConfigError); a tiny preset's are its defaults,
    overridden by the config's fields, its vocabulary the tokenizer's (as the workers build it). Where
    config.json cannot be read, the config's values (model.*, then model.offline_dims). They only steer the
    plan's balance and memory: a wrong value never changes the math of a step.
    """
    if is_tiny_preset(model.name_or_path):
        return _tiny_dims(model, tokenizer)
    from app.model.dims import resolved_model

    resolved = resolved_model(model)
    given = (resolved.hidden_size, resolved.kv_hidden_size, resolved.num_layers)
    if not all(given):
        raise ConfigError(
            f"the cost model needs the model's dimensions and model.name_or_path={model.name_or_path!r} has "
            "no readable config.json (not a local directory, not in the Hugging Face cache); set "
            "model.offline_dims: {hidden_size, kv_hidden_size, num_layers, intermediate_size, vocab_size, "
            "num_params} (e.g. Qwen2.5-0.5B: 896, 128, 24, 4864, 151936, 494032768), or run `train` once "
            "with network access (it downloads config.json)")
    return ModelDims(*given, resolved.intermediate_size, resolved.vocab_size, resolved.num_params)


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
                     model.intermediate_size or TINY_DEFAULTS["intermediate_size"], vocab, model.num_params)


def cost_model_from_config(model: ModelConfig, hardware: HardwareConfig, *, formula: CostFormula = "paper",
                           tokenizer: str | TextTokenizer = "qwen") -> CostModel:
    """The cost model (scheduling.cost_formula) of the model's dimensions on hardware.profile.

    The paper formula reads h, h_kv and L only, so it never loads the tokenizer for a tiny preset's
    vocabulary (its parameter estimate keeps Qwen's vocabulary unless model.vocab_size is set).
    """
    if formula == "model" or not is_tiny_preset(model.name_or_path):
        dims = model_dims(model, tokenizer)
    else:  # a tiny preset's vocabulary would load the tokenizer: the paper formula does not read it
        dims = model_dims(dataclasses.replace(model, vocab_size=model.vocab_size or 1), tokenizer)
        dims = dataclasses.replace(dims, vocab_size=model.vocab_size)
    if formula != "model":
        dims = dataclasses.replace(dims, intermediate_size=0)
    return CostModel.from_model_dims(
        hidden_size=dims.hidden_size, kv_hidden_size=dims.kv_hidden_size, num_layers=dims.num_layers,
        profile=load_hardware_profile(hardware.profile), num_params=dims.num_params, formula=formula,
        intermediate_size=dims.intermediate_size, vocab_size=dims.vocab_size)


def cost_model(config: SkrullConfig, *, tokenizer: TextTokenizer | None = None) -> CostModel:
    """The run's cost model: scheduling.cost_formula over the model's dimensions and hardware.profile;
    `tokenizer`: the run's loaded one (else data.tokenizer is loaded when a tiny preset needs its size)."""
    return cost_model_from_config(config.model, config.hardware, formula=config.scheduling.cost_formula,
                                  tokenizer=tokenizer or config.data.tokenizer)
