"""The model's dimensions from its own config.json: what the cost and memory models and `plan` size by.

    model.hidden_size        <- hidden_size                   model.num_layers   <- num_hidden_layers
    model.num_attention_heads <- num_attention_heads          model.num_key_value_heads <- num_key_value_heads
    model.kv_hidden_size     <- num_key_value_heads x head_dim (head_dim: hidden_size / heads when absent)
    model.intermediate_size  <- intermediate_size             model.vocab_size   <- vocab_size
    model.num_params         <- the checkpoint's safetensors headers (every tensor's shape, summed), else
                                the sum over the architecture's shapes for the llama-like families

A key left at 0 takes config.json's value; a key set to another value is a ConfigError naming it and both
values (the YAML was written for another model), except model.vocab_size with model.random_init, which
resizes the random model's vocabulary (workers/models.py). Where no config.json can be read (`plan` for a
hub id that is not in the local Hugging Face cache: it reads no network; `train` fetches it first), the
YAML's values are used, the explicit ones before model.offline_dims, and `dims_note` says so in one line.
Tiny presets have no config.json: their dimensions are the YAML's and the preset's (workers/presets.py).

Read as JSON (app/model/support.py model_config_dict): nothing here imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

from app.config import DIMENSION_KEYS as DIM_KEYS
from app.config import ConfigError, ModelConfig
from workers.presets import is_tiny_preset

LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral")
"""Families whose parameter count `architecture_params` adds up from config.json alone."""


def config_json_dims(hf: dict[str, Any], directory: Path | None = None) -> dict[str, int]:
    """The DIM_KEYS of a config.json (a dict); num_params from the weights in `directory` when it holds
    them, else from the architecture (0 where neither counts it)."""
    dims = shape_dims(hf)
    counted = checkpoint_params(directory) if directory is not None else None
    dims["num_params"] = counted or architecture_params(hf) or 0
    return dims


def shape_dims(hf: dict[str, Any]) -> dict[str, int]:
    """DIM_KEYS but num_params, from a config.json."""
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    return {"hidden_size": hidden, "kv_hidden_size": kv_heads * head_dim_of(hf),
            "num_layers": int(hf["num_hidden_layers"]),
            "intermediate_size": int(hf.get("intermediate_size") or 0), "vocab_size": int(hf["vocab_size"]),
            "num_attention_heads": heads, "num_key_value_heads": kv_heads}


def head_dim_of(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))


def checkpoint_params(directory: Path) -> int | None:
    """Elements of every tensor in the directory's safetensors files, from their headers (each file starts
    with an 8-byte little-endian length and that many bytes of JSON: name -> dtype, shape, offsets); None
    when the directory holds none, or not all of the index's files (a hub snapshot with its config only)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [directory / "model.safetensors"]
    if not all(file.is_file() for file in files):
        return None
    total = 0
    for file in files:
        with file.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                total += _product(entry["shape"])
    return total


def _product(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def architecture_params(hf: dict[str, Any]) -> int | None:
    """The parameter count of a llama-like decoder (LLAMA_LIKE) from its config.json, else None.

    Embedding V x h, per layer q/o h x (heads x head_dim), k/v h x (kv_heads x head_dim), the gated MLP
    3 x h x I, two RMSNorms of h (Qwen3: also q_norm and k_norm of head_dim), biases (Qwen2: q, k, v;
    llama, mistral, Qwen3 with attention_bias: q, k, v, o; llama's mlp_bias: gate, up, down), the final
    norm, and an LM head V x h unless tie_word_embeddings.
    """
    family = hf.get("model_type")
    if family not in LLAMA_LIKE:
        return None
    dims = shape_dims(hf)
    h, vocab, inter = dims["hidden_size"], dims["vocab_size"], dims["intermediate_size"]
    q_width, kv_width = dims["num_attention_heads"] * head_dim_of(hf), dims["kv_hidden_size"]
    layer = 2 * h * q_width + 2 * h * kv_width + 3 * h * inter + 2 * h
    if family == "qwen2":
        layer += q_width + 2 * kv_width
    elif hf.get("attention_bias"):
        layer += q_width + 2 * kv_width + h
    if hf.get("mlp_bias"):
        layer += 2 * inter + h
    if family == "qwen3":
        layer += 2 * head_dim_of(hf)
    head = 0 if hf.get("tie_word_embeddings") else vocab * h
    return vocab * h + dims["num_layers"] * layer + h + head


def model_directory_of(model: ModelConfig) -> Path | None:
    """The local directory of model.name_or_path's files: the directory itself, or the hub cache snapshot
    that holds its config.json (no network)."""
    from app.model.support import cached_hub_file

    local = Path(model.name_or_path).expanduser()
    if local.is_dir():
        return local
    found = cached_hub_file(model.name_or_path, "config.json")
    return found.parent if found is not None else None


def checkpoint_dims(model: ModelConfig) -> dict[str, int] | None:
    """DIM_KEYS from model.name_or_path's config.json (a random_init run's vocabulary resized by
    model.vocab_size, its parameters counted from the shapes), or None where it cannot be read."""
    from app.model.support import model_config_dict

    if is_tiny_preset(model.name_or_path):
        return None
    hf = model_config_dict(model)
    if not hf:
        return None
    if model.random_init:
        hf = {**hf, "vocab_size": model.vocab_size or hf["vocab_size"]}
        return config_json_dims(hf)
    return config_json_dims(hf, model_directory_of(model))


def check_dims(model: ModelConfig, found: dict[str, int]) -> None:
    """ConfigError for the first model.<key> set to a value config.json contradicts (naming both)."""
    for key in DIM_KEYS:
        given = getattr(model, key)
        if not given or not found.get(key) or given == found[key]:
            continue
        if key == "vocab_size" and model.random_init:
            continue  # resizes the random model (workers/models.py)
        raise ConfigError(
            f"model.{key}={given} disagrees with model.name_or_path={model.name_or_path!r}, whose "
            f"config.json gives {key} {found[key]}: remove model.{key} (the checkpoint's own is used) or "
            "choose the model it was written for")


def resolved_model(model: ModelConfig) -> ModelConfig:
    """model.* DIM_KEYS filled in: from config.json (check_dims first), else the explicit values and then
    model.offline_dims; a tiny preset unchanged."""
    found = checkpoint_dims(model)
    if found is None:
        if is_tiny_preset(model.name_or_path):
            return model
        fallback = {key: value for key, value in model.offline_dims.items() if not getattr(model, key)}
        return dataclasses.replace(model, **fallback)
    check_dims(model, found)
    return dataclasses.replace(model, **{key: getattr(model, key) or value for key, value in found.items()})


def dims_note(model: ModelConfig) -> str | None:
    """One line where the YAML's dimensions stand in for an unreadable config.json; None otherwise."""
    if is_tiny_preset(model.name_or_path) or checkpoint_dims(model) is not None:
        return None
    given = [key for key in DIM_KEYS if getattr(model, key) or key in model.offline_dims]
    if not given:
        return None
    return (f"model.name_or_path={model.name_or_path!r}: its config.json cannot be read here (not a local "
            "directory, not in the Hugging Face cache; `train` downloads it), so the config's "
            f"dimensions are used ({', '.join(given)})")
