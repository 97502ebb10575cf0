"""train.compile: each decoder layer compiled with torch.compile, the DACP attention inside as a custom op.

    every decoder layer's class -> a subclass whose __call__ is torch.compile(LayerClass.__call__, dynamic)
    model's attention implementation -> "dacp_op" (workers/attention/hf.py -> workers/attention/op.py)

Per layer rather than the whole model: the 24-80 layers of a decoder share one code, so dynamo compiles one
graph (and its backward) for all of them. The layer's whole call is compiled, activation checkpointing
included, so the checkpoint runs inside the graph (dynamo's activation-checkpoint op: the compiled backward
recomputes what the checkpoint drops) whichever of transformers' versions wraps it (5.17 checkpoints the
layer's __call__, later versions its forward); compiling only the module's own call would put the compiled
region inside the checkpoint's saved-tensor hooks instead. The subclass keeps the layer's parameters and
module path, so state dicts, checkpoints and exports do not change. `dynamic=True`: the token count changes
every micro-batch, so it is a symbolic size from the first compile on instead of a recompile per length
(sizes 0 and 1 are specialized by torch: the one-token idle micro-batch compiles once more).
The attention runs as an opaque op whose inputs are tensors only, so no graph guards on the micro-batch's
layout (workers/attention/op.py says why and how it reaches the op).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from workers.attention.hf import register_dacp_op_attention

COMPILED = "skrull_compiled_layers"
"""Attribute set on a model whose layers are compiled (workers/forward.py passes the layout by context)."""
BACKEND = "inductor"
"""torch.compile's backend (tests trace with "aot_eager": dynamo and AOT autograd without code generation)."""


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
        layer.__class__ = compiled_class(type(layer), BACKEND)
    setattr(model, COMPILED, True)


@functools.cache
def compiled_class(layer_class: type, backend: str) -> type:
    """`layer_class` with its __call__ compiled (one compiled callable per class: every layer shares it)."""
    compiled = torch.compile(layer_class.__call__, dynamic=True, backend=backend)

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return compiled(self, *args, **kwargs)

    return type(f"Compiled{layer_class.__name__}", (layer_class,),
                {"__call__": __call__, "__module__": layer_class.__module__})


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
