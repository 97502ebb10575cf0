"""The DACP attention as a torch custom op, for decoder layers compiled with torch.compile.

    forward.py, per micro-batch:   with attention_call(index, runtime):  model(...)     (no dacp_* kwargs)
    each layer's attention:        out, lse = torch.ops.skrull.dacp_attention(q, k, v, scale)
    its backward:                  dq, dk, dv = torch.ops.skrull.dacp_attention_backward(...)

A compiled graph cannot take the micro-batch's DacpIndex or AttentionRuntime as inputs: they are Python
objects, and dynamo would guard on what it reads of them (the layout's lengths), recompiling for every
micro-batch. So the op takes tensors alone and reads the micro-batch's index and runtime from the call
context that `attention_call` sets for the whole micro-batch. The context stays set until the next
micro-batch's forward, because the op's backward (and an activation-checkpointed layer's recompute) runs
inside the same micro-batch's backward, after its forward returned; workers/step.py runs each micro-batch's
forward and backward before the next one's forward (the chunkflow policy, whose chunk forwards run ahead of
their backwards, is refused with train.compile in app/config.py). A process-wide holder, not a
ContextVar: CUDA backward runs on autograd's own device thread, which does not see the caller's context.

For dynamo the op is opaque (a fake implementation gives its output shapes), so a compiled layer is one
graph around it, with dynamic token counts and no graph break.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from workers.attention.dacp import dacp_attention_backward_parts, dacp_attention_forward_parts
from workers.attention.index import DacpIndex
from workers.attention.runtime import AttentionRuntime


@dataclass(frozen=True, slots=True)
class AttentionCall:
    index: DacpIndex
    runtime: AttentionRuntime
    overlap: bool = True


_CURRENT: list[AttentionCall] = []
"""The active micro-batch's call (at most one entry): see the module docstring for why it is global."""


@contextlib.contextmanager
def attention_call(index: DacpIndex, runtime: AttentionRuntime, overlap: bool = True) -> Iterator[None]:
    """Make (index, runtime) what every dacp op call reads until the next micro-batch replaces it.

    On exit the call stays installed: the micro-batch's backward (after the forward returned) reads it.
    """
    _CURRENT[:] = [AttentionCall(index, runtime, overlap)]
    yield


def current_call() -> AttentionCall:
    if not _CURRENT:
        raise RuntimeError("torch.ops.skrull.dacp_attention ran outside a micro-batch: workers/forward.py "
                           "installs each micro-batch's index with attention_call(...)")
    return _CURRENT[0]


@torch.library.custom_op("skrull::dacp_attention", mutates_args=())
def dacp_attention_op(q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D], lse [H, T] fp32) of the current micro-batch's DACP attention."""
    call = current_call()
    return dacp_attention_forward_parts(q_THD, k_KGD, v_KGD, call.index, call.runtime, scale, call.overlap)


@dacp_attention_op.register_fake
def _(q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, heads, _ = q_THD.shape
    return q_THD.new_empty(q_THD.shape), q_THD.new_empty((heads, tokens), dtype=torch.float32)


@torch.library.custom_op("skrull::dacp_attention_backward", mutates_args=())
def dacp_attention_backward_op(dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
                               v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = current_call()
    return dacp_attention_backward_parts(dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, call.index,
                                         call.runtime, scale, call.overlap)


@dacp_attention_backward_op.register_fake
def _(dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
      out_THD: torch.Tensor, lse_HT: torch.Tensor,
      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q_THD.new_empty(q_THD.shape), k_KGD.new_empty(k_KGD.shape), v_KGD.new_empty(v_KGD.shape)


def _setup_context(ctx, inputs, output) -> None:
    q_THD, k_KGD, v_KGD, scale = inputs
    out_THD, lse_HT = output
    ctx.save_for_backward(q_THD, k_KGD, v_KGD, out_THD, lse_HT)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse_HT)


def _backward(ctx, dout_THD: torch.Tensor, _dlse: torch.Tensor):
    q_THD, k_KGD, v_KGD, out_THD, lse_HT = ctx.saved_tensors
    dq, dk, dv = dacp_attention_backward_op(dout_THD.contiguous(), q_THD, k_KGD, v_KGD, out_THD, lse_HT,
                                            ctx.scale)
    return dq, dk, dv, None


dacp_attention_op.register_autograd(_backward, setup_context=_setup_context)
