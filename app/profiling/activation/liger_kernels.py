"""The liger kernel set (liger-kernel's fused RMSNorm, SwiGLU, RoPE and fused linear cross-entropy), per
token. Derived from liger-kernel's source (src/liger_kernel/ops/: rms_norm.py, swiglu.py, rope.py,
fused_linear_cross_entropy.py). The CPU ledger (tests/test_memory_model.py) cannot run liger's kernels;
tests/test_liger_interpreted.py counts what liger's own Functions save per token (Triton's interpreter on CPU,
autograd's saved-tensor hooks) against `layer` and `head`'s kept bytes, and tests/test_kernels_cuda.py does
the same on a GPU.

    LigerRMSNorm      saves X (its input, in the model's dtype) and RSTD (fp32, one per row); its output Y
                      is saved by the projections after it: e h + 4 + e h. The backward writes dX into dY
                      (no per-token temporary; its dW partial sums are [SMs, h])
    LigerRopeFunction rotates q and k in place and saves only cos and sin (q and k are contiguous in their
                      [T, heads, d] layout already; with a fused qkv they are made contiguous copies)
    LigerSiLUMulFunction  saves a (gate) and b (up); its output c is down_proj's saved input: 3 e I. The
                      backward writes its gradients into a and b: only dc (e I) beyond the saved set.
    fused linear CE   forward computes the input and weight gradients chunk by chunk, chunk_size =
                      next_pow2(ceil(BT / ceil(V / h))) rows, so a chunk's [chunk, V] logits in the model's
                      dtype are about 2 e h bytes per token of the input (next_pow2 at most doubles);
                      grad_input [e h] and grad_weight are saved; with accum_dtype=fp32 the [V, h] weight
                      gradient accumulates in fp32 and is cast once at the end (4 + e bytes per element
                      at that moment). The input is taken as a gathered copy of the label rows (e h).
"""

from __future__ import annotations

import math

from app.profiling.activation.kernel_set import INDEX_BYTES, HeadBytes, LayerBytes, attention_parts
from app.profiling.activation.shape import ModelShape

name = "liger"


def _norm(shape: ModelShape) -> float:
    """LigerRMSNorm's X and RSTD, and its output Y: 2 e h + 4."""
    return 2.0 * shape.element * shape.hidden + 4.0


def layer(shape: ModelShape) -> LayerBytes:
    e, h, inter = shape.element, shape.hidden, shape.intermediate
    parts = {"input_norm": _norm(shape), **attention_parts(shape, q_copy=shape.fused_qkv),
             "post_norm": _norm(shape), "mlp": 3.0 * e * inter}
    return LayerBytes(parts=parts, shared_input=e * h, backward_extra=e * inter + 2.0 * e * h)


def head(shape: ModelShape, loss_chunk_tokens: int) -> HeadBytes:
    """`loss_chunk_tokens` is our chunked loss's knob: liger sizes its own chunks (module docstring)."""
    e, h, vocab = shape.element, shape.hidden, shape.vocab
    rotary = 2.0 * e * shape.head_dim
    parts = {"final_norm": e * h + 4.0, "loss_input_grad": e * h, "rotary": rotary,
             "batch": float(INDEX_BYTES)}
    chunk_per_token = 2.0 * e * vocab / math.ceil(vocab / h)
    return HeadBytes(kept=sum(parts.values()), after_loss=rotary + INDEX_BYTES,
                     loss_extra=2.0 * e * h + 4.0 + 1.0 + chunk_per_token,
                     loss_fixed=(4.0 + e) * vocab * h + 2.0 * e * vocab, head_grad=e * vocab * h,
                     norm_backward=0.0, parts=parts)
