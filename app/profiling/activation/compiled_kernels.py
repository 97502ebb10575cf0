"""The compiled kernel set (train.compile: transformers' own modules in every decoder layer, each layer one
torch.compile graph): what AOT autograd's partitioner saves for the backward, per token.

The partitioner (torch._functorch.partitioners.min_cut_rematerialization_partition, inductor's) saves the
inputs of the layer's matrix products and the few values it cannot cheaply recompute, and recomputes the
elementwise work (RMSNorm's fp32 upcast and scaling, SiLU) inside the backward graph:

    layer input       x [e h]: the input norm's backward recomputes from it
    each RMSNorm      its rsqrt [4] and its output [e h] (the next projections' input); the post-norm's
                      input (the residual sum after attention) [e h]
    attention         q, k, v, out, lse as the DACP attention op saves them (attention_parts)
    gated MLP         gate, up and their product [3 e I] (SiLU(gate) is recomputed)
    backward extra    the MLP's backward holds the gradient of the product and those of gate and up at once
                      (3 e I), and the gradient flowing in and the one it accumulates (2 e h)

Outside the layers the model runs eagerly, so the head (final norm, chunked loss, rotary tables, batch) is
the torch set's. Measured, not only derived: tests/test_activation_memory.py compiles small Qwen2, Llama-3,
Mistral and Phi-3 models on CPU with torch.compile and sums the storages autograd's saved-tensor hooks
receive (the compiled graph allocates outside torch's dispatcher, where the tensor ledger cannot see).
"""

from __future__ import annotations

from app.profiling.activation import torch_kernels
from app.profiling.activation.kernel_set import HeadBytes, LayerBytes, attention_parts
from app.profiling.activation.shape import ModelShape

name = "compiled"


def layer(shape: ModelShape) -> LayerBytes:
    e, h, inter = shape.element, shape.hidden, shape.intermediate
    norm = 4.0 + e * h
    parts = {"input": e * h, "input_norm": norm, **attention_parts(shape, q_copy=True), "residual": e * h,
             "post_norm": norm, "mlp": 3.0 * e * inter}
    return LayerBytes(parts=parts, shared_input=e * h, backward_extra=3.0 * e * inter + 2.0 * e * h)


def head(shape: ModelShape, loss_chunk_tokens: int) -> HeadBytes:
    return torch_kernels.head(shape, loss_chunk_tokens)
