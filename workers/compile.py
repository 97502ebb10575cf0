"""train.compile: each decoder layer compiled with torch.compile, the DACP attention inside as a custom op.

    for layer in model.get_decoder().layers:  layer.compile(dynamic=True)
    model's attention implementation:         "dacp_op" (workers/attention/hf.py -> workers/attention/op.py)

Per layer rather than the whole model: the 24-80 layers of a decoder share one code object, so dynamo
compiles one graph (and its backward) for all of them, and transformers' activation checkpointing keeps
wrapping each layer's call (the compiled call runs inside the checkpoint). `dynamic=True`: the token count
changes every micro-batch, so it is a symbolic size from the first compile on instead of a recompile per
length (sizes 0 and 1 are specialized by torch: the one-token idle micro-batch compiles once more).
The attention runs as an opaque op whose inputs are tensors only, so no graph guards on the micro-batch's
layout (workers/attention/op.py says why and how it reaches the op).
"""

from __future__ import annotations

import os

import torch

from workers.attention.hf import register_dacp_op_attention

COMPILED = "skrull_compiled_layers"
"""Attribute set on a model whose layers are compiled (workers/forward.py passes the layout by context)."""


def compile_layers(model: torch.nn.Module) -> None:
    """Compile every decoder layer of `model` in place and route its attention through the custom op."""
    import torch._dynamo

    if torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        print("[skrull] warning: train.compile=true, but TORCHDYNAMO_DISABLE is set in this process: "
              "torch.compile runs nothing, the layers run eagerly", flush=True)
    name = register_dacp_op_attention()
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        model.config._attn_implementation = name
    for layer in model.get_decoder().layers:
        layer.compile(dynamic=True)
    setattr(model, COMPILED, True)


def is_compiled(model: torch.nn.Module) -> bool:
    return bool(getattr(model, COMPILED, False))


def sliding_window_problem(model: torch.nn.Module, longest: int) -> str | None:
    """Why a compiled model cannot attend a micro-batch whose longest sequence has `longest` tokens: a
    sliding window shorter than it (the dacp attention has none; app/model/support.py refuses such models
    before Ray starts, this is the safety net), or None."""
    windows = [w for layer in model.get_decoder().layers
               if (w := getattr(getattr(layer, "self_attn", None), "sliding_window", None))]
    if windows and min(windows) < longest:
        return (f"the dacp attention has no sliding window: a {min(windows)}-token window is shorter than a "
                f"{longest}-token sequence of this micro-batch")
    return None
