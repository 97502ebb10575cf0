"""The compiled layers with liger's loss (train.compile with `model.kernels: auto` on CUDA where liger runs:
workers/kernels/liger_loss_set.py), per token: the layers as compiled_kernels.py counts them, the final
RMSNorm as the torch set runs it (eagerly, outside the compiled layers), the loss as liger's fused linear
cross-entropy holds it (liger_kernels.py)."""

from __future__ import annotations

import dataclasses

from app.profiling.activation import compiled_kernels, liger_kernels, torch_kernels
from app.profiling.activation.kernel_set import HeadBytes, LayerBytes
from app.profiling.activation.shape import ModelShape

name = "compiled_liger_loss"


def layer(shape: ModelShape) -> LayerBytes:
    return compiled_kernels.layer(shape)


def head(shape: ModelShape, loss_chunk_tokens: int) -> HeadBytes:
    """liger's loss terms, with the torch set's final norm (its saved upcast, its backward's temporaries)."""
    torch_head, liger_head = torch_kernels.head(shape, loss_chunk_tokens), liger_kernels.head(shape,
                                                                                             loss_chunk_tokens)
    parts = {**liger_head.parts, "final_norm": torch_head.parts["final_norm"]}
    return dataclasses.replace(liger_head, kept=sum(parts.values()), parts=parts,
                               norm_backward=torch_head.norm_backward)
