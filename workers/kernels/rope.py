"""Which RoPE function a model family's attention calls: transformers' modeling modules call their
module-level `apply_rotary_pos_emb` by name, so a kernel set installs its own there (workers/kernels)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch

_ORIGINALS: dict[str, Callable] = {}
"""modeling module name -> transformers' own apply_rotary_pos_emb, saved before the first replacement."""


def modeling_module(model: torch.nn.Module) -> ModuleType | None:
    """The transformers modeling module of `model`'s decoder layers (None: not a transformers model)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers:
        return None
    module = importlib.import_module(type(layers[0]).__module__)
    return module if hasattr(module, "apply_rotary_pos_emb") else None


def original_rope(model: torch.nn.Module) -> Callable | None:
    module = modeling_module(model)
    if module is None:
        return None
    return _ORIGINALS.setdefault(module.__name__, module.apply_rotary_pos_emb)


def install_rope(model: torch.nn.Module, function: Callable | None) -> None:
    """Make `model`'s family call `function` for RoPE (None: leave it)."""
    module = modeling_module(model)
    if module is None or function is None:
        return
    _ORIGINALS.setdefault(module.__name__, module.apply_rotary_pos_emb)
    module.apply_rotary_pos_emb = function
