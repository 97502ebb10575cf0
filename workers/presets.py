"""Tiny model presets: names and default dimensions, torch-free.

The driver reads them for the cost model and the pre-start checks (`python -m app plan` must never import
torch), and `workers.models` builds them. Small enough for CPU tests (hidden 64, 2 layers) with GQA on
by default (4 heads, 2 KV heads).
"""

from __future__ import annotations

TINY_PRESETS = ("tiny-qwen2", "tiny-llama")
"""Architectures built from transformers' Qwen2 / Llama configs with these dims and random weights."""

TINY_DEFAULTS: dict[str, int] = dict(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128)


LIGER_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""model_type values the liger kernel set covers (workers/kernels: RMSNorm with llama casting, a gated SiLU
MLP, rotate-half RoPE over the whole head); other families train with the torch set."""

TINY_MODEL_TYPES = {"tiny-qwen2": "qwen2", "tiny-llama": "llama"}


def is_tiny_preset(name_or_path: str) -> bool:
    return name_or_path in TINY_PRESETS
