"""Activation memory from the model's own shapes (docs/memory.md): what a forward keeps per token for each
kernel set and checkpointing setting, and the phases of a micro-batch's peak.

    KERNEL_SETS["torch" | "liger" | "compiled" | "compiled_liger_loss"]    one module each (KernelSet)
    model_shape(config)               the run's ModelShape
    pass_memory(shape, KERNEL_SETS[k], Checkpointing(every, offload), loss_chunk_tokens)  -> PassMemory
"""

from __future__ import annotations

from app.profiling.activation import (
    compiled_kernels,
    compiled_liger_loss_kernels,
    liger_kernels,
    torch_kernels,
)
from app.profiling.activation.checkpointing import Checkpointing
from app.profiling.activation.kernel_set import HeadBytes, KernelSet, LayerBytes
from app.profiling.activation.phases import PassMemory, Phase, pass_memory
from app.profiling.activation.shape import ModelShape, model_shape, shape_from_hf

KERNEL_SETS: dict[str, KernelSet] = {module.name: module for module in (
    torch_kernels, liger_kernels, compiled_kernels, compiled_liger_loss_kernels)}
"""What each set's modules keep: model.kernels' resolved values (`torch` on CPU), and under train.compile
`compiled` (the torch set's layers compiled) and `compiled_liger_loss` (those, with liger's loss)."""


def kernel_set(name: str) -> KernelSet:
    try:
        return KERNEL_SETS[name]
    except KeyError:
        raise ValueError(f"kernel set {name!r} is not one of: {', '.join(KERNEL_SETS)}") from None


__all__ = ["KERNEL_SETS", "Checkpointing", "HeadBytes", "KernelSet", "LayerBytes", "ModelShape", "PassMemory",
           "Phase", "kernel_set", "model_shape", "pass_memory", "shape_from_hf"]
