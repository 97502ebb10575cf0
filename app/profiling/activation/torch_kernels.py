"""The torch kernel set: transformers' own modules, what autograd saves of each (counted per token).

    RMSNorm (upcast)  x.float() [4h, the input itself in fp32]; x * rsqrt(var) cast back [e h]; its
                      output, saved by the projections after it [e h]; rsqrt [4]
    attention         q, k, v (after RoPE, whose products save only cos and sin), out, lse; o_proj's
                      input is a view of that out (attention_parts)
    gated MLP         gate [e I] (SiLU's input), SiLU(gate) and up [2 e I] (the product's inputs),
                      their product [e I] (down_proj's input)
    backward extra    the MLP's backward holds grad(gate*up), grad(SiLU(gate)) and grad(up) at once
                      before it frees the product and its inputs: +2 e I over the saved set; plus the
                      gradient flowing in and the one it accumulates [2 e h]
    norm backward     RMSNorm's backward (autograd through its upcast ops) holds five fp32 [T, h]
                      temporaries at once [20 h]: the final norm's, while every layer's saved set is alive,
                      is the peak of a pass that recomputes nothing when I < 6 h
    head              final norm as above without its output (the loss does not save it); the chunked
                      loss (workers/loss.py) saves d_hidden [e h] and a [V, h] fp32 gradient, and at its
                      peak holds one chunk's fp32 logits and one temporary of that size (8 bytes x chunk x V)

Counted from the modules' code (transformers' modeling_qwen2/llama/mistral/phi3 and workers/), and
measured: tests/test_memory_model.py compares it with what the forward keeps by torch's own accounting
(workers/tools/tensor_ledger.py) for each family and checkpointing setting.
"""

from __future__ import annotations

from app.profiling.activation.kernel_set import INDEX_BYTES, HeadBytes, LayerBytes, attention_parts
from app.profiling.activation.shape import ModelShape

name = "torch"


def _norm(shape: ModelShape) -> float:
    """A pre-norm's saved tensors including its output: 4h + 2 e h + 4."""
    return 4.0 * shape.hidden + 2.0 * shape.element * shape.hidden + 4.0


def layer(shape: ModelShape) -> LayerBytes:
    e, h, inter = shape.element, shape.hidden, shape.intermediate
    parts = {"input_norm": _norm(shape), **attention_parts(shape, q_copy=True), "post_norm": _norm(shape),
             "mlp": 4.0 * e * inter}
    # In fp32 the upcast is the input itself: a checkpointed layer already keeps it.
    shared = 4.0 * h if e == 4 else 0.0
    return LayerBytes(parts=parts, shared_input=shared, backward_extra=2.0 * e * inter + 2.0 * e * h)


def head(shape: ModelShape, loss_chunk_tokens: int) -> HeadBytes:
    e, h, vocab = shape.element, shape.hidden, shape.vocab
    rotary = 2.0 * e * shape.head_dim
    parts = {"final_norm": 4.0 * h + e * h + 4.0, "loss_input_grad": e * h, "rotary": rotary,
             "batch": float(INDEX_BYTES)}
    return HeadBytes(kept=sum(parts.values()), after_loss=rotary + INDEX_BYTES, loss_extra=e * h,
                     loss_fixed=8.0 * loss_chunk_tokens * vocab + 4.0 * vocab * h, head_grad=e * vocab * h,
                     norm_backward=20.0 * h, parts=parts)
