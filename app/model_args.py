"""`workers.models.build_model` keyword arguments from the config tree (train workers, bench compute)."""

from __future__ import annotations

from typing import Any

from app.config import SkrullConfig
from workers.presets import is_tiny_preset


def model_build_kwargs(config: SkrullConfig) -> dict[str, Any]:
    m = config.model
    vocab_size = m.vocab_size
    if not vocab_size and is_tiny_preset(m.name_or_path):
        from app.data.tokenizer import load_tokenizer

        # A random-init preset must cover every id the configured tokenizer emits.
        vocab_size = load_tokenizer(config.data.tokenizer).vocab_size
    return {
        "name_or_path": m.name_or_path, "random_init": m.random_init, "dtype": m.dtype,
        "vocab_size": vocab_size, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads, "hidden_size": m.hidden_size,
        "num_layers": m.num_layers, "intermediate_size": m.intermediate_size, "seed": config.train.seed,
        "activation_checkpointing": config.train.activation_checkpointing,
    }
