"""The worker's `ModelSpec` from the config's model section (train workers, bench compute)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import ModelConfig, TrainConfig
from workers.models import ModelSpec
from workers.presets import is_tiny_preset

if TYPE_CHECKING:
    from app.data.tokenizer import TextTokenizer


def model_spec(model: ModelConfig, train: TrainConfig, *, tokenizer: str | TextTokenizer) -> ModelSpec:
    """`tokenizer` (data.tokenizer, or the run's loaded one) sizes a random-init preset's vocabulary when
    model.vocab_size is 0."""
    if train.activation_checkpointing == "auto":
        raise ValueError("train.activation_checkpointing=auto is chosen before a model is built "
                         "(app/profiling/budget.py resolve_bucket_size)")
    vocab_size = model.vocab_size
    if not vocab_size and is_tiny_preset(model.name_or_path):
        from app.data.tokenizer import vocab_size_of

        # A random-init preset must cover every id the configured tokenizer emits.
        vocab_size = vocab_size_of(tokenizer)
    return ModelSpec(
        name_or_path=model.name_or_path, random_init=model.random_init, dtype=model.dtype,
        vocab_size=vocab_size, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads, hidden_size=model.hidden_size,
        num_layers=model.num_layers, intermediate_size=model.intermediate_size, seed=train.seed,
        activation_checkpointing=train.activation_checkpointing,
        activation_checkpointing_every=train.activation_checkpointing_every,
        activation_offload=train.activation_offload, attention_backend=model.attention_backend,
        kernels=model.kernels, compile=train.compile,
        lora_r=model.lora.r, lora_alpha=model.lora.alpha, lora_dropout=model.lora.dropout,
        lora_target_modules=(model.lora.target_modules if isinstance(model.lora.target_modules, str)
                             else tuple(model.lora.target_modules)),
    )
