"""What one kernel set's forward keeps, as bytes per token: the protocol each set's module implements.

A kernel set (`model.kernels`: torch | liger; `compiled`: torch's layers under train.compile) decides which
tensors a forward saves for its backward. Each set is one module (torch_kernels.py, liger_kernels.py,
compiled_kernels.py) registered in KERNEL_SETS
(app/profiling/activation/__init__.py); phases.py turns their bytes into a micro-batch's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from app.profiling.activation.shape import ModelShape

INDEX_BYTES = 4 * 8
"""Per token: the batch's int64 input ids, positions, targets and label rows on the device."""


@dataclass(frozen=True, slots=True)
class LayerBytes:
    """One decoder layer, bytes per token."""

    parts: dict[str, float]
    """What its forward keeps for its backward, by tensor (the sum is `saved`)."""
    shared_input: float
    """Of `saved`, the layer's own input: a checkpointed layer keeps it anyway (its recompute adds the
    rest)."""
    backward_extra: float
    """What its backward holds beyond `saved` at its peak: gradients of the MLP's intermediates and the
    gradient flowing in."""

    @property
    def saved(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True, slots=True)
class HeadBytes:
    """Everything outside the decoder layers: the final norm, the loss, the rotary tables, the batch."""

    kept: float
    """Per token, kept after the forward (the final norm's saved tensors, the loss's saved input
    gradient, the rotary tables, the batch's index tensors)."""
    after_loss: float
    """Per token, of `kept`, what is still alive once the loss's and the final norm's backward ran."""
    loss_extra: float
    """Per token, alive only while the loss's forward runs (the final hidden states it reads, ...)."""
    loss_fixed: float
    """Bytes at the loss's peak that do not grow with the micro-batch (a chunk's logits and their
    temporaries, the LM head's gradient accumulator)."""
    head_grad: float
    """Bytes of the LM head's gradient in the weights' dtype, alive through the decoder's backward."""
    norm_backward: float
    """Per token, what the final norm's backward holds at once beyond `kept` less the loss's saved
    gradient (its temporaries), while every layer's saved tensors are still alive."""
    parts: dict[str, float] = field(default_factory=dict)
    """`kept` by tensor."""


class KernelSet(Protocol):
    name: str

    def layer(self, shape: ModelShape) -> LayerBytes: ...

    def head(self, shape: ModelShape, loss_chunk_tokens: int) -> HeadBytes: ...


def attention_parts(shape: ModelShape, *, q_copy: bool) -> dict[str, float]:
    """What the DACP attention keeps (workers/attention/dacp.py saves q, k, v, out, lse; o_proj saves a
    view of that same out: the HF glue returns it uncopied), either kernel set. With a fused qkv
    projection v is a view of the qkv output, which stays alive whole; `q_copy`: q and k are separate
    tensors from it then (the rotary embedding wrote them), always true when the projections are separate."""
    e, h, hkv = shape.element, shape.hidden, shape.kv_hidden
    parts = {"q": e * h if q_copy or not shape.fused_qkv else 0.0, "k": e * hkv}
    parts["v" if not shape.fused_qkv else "qkv"] = e * hkv if not shape.fused_qkv else e * (h + 2 * hkv)
    parts.update({"attention_out": e * h, "attention_lse": 4.0 * shape.heads})
    return parts
