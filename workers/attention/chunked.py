"""Attention of one dependent chunk (the chunkflow policy): its queries against its sequence's earlier keys.

Chunk i of a sequence holds tokens [s, s + c). Its queries attend to every key of the chunks before it and,
causally, to its own; the mask is aligned bottom-right (query j sees keys [0, s + j]):

    keys     [ chunk 0 | ... | chunk i-1 | chunk i ]
    query j  [ all     | ... | all       | <= j    ]
             |<-- prior: the store's -->|<- diag: own k, v (the micro-batch's local causal block)
             detached K/V, full block

Two kernel calls of the attention registry (workers/attention/kernels.py), merged by log-sum-exp as the
ring merges its blocks (workers/attention/ring.py merge_lse): the kernels' causal mask is square and
top-left aligned, so the prior keys go in their own full (non-causal) block.

The store (`ChunkKV`, one per sequence, shared by its chunks' micro-batches) holds, per layer, the
sequence's K and V (detached: written by each chunk's forward) and the fp32 gradient of the loss of the
later chunks with respect to them. Backward runs in reverse chunk order (workers/chunkflow.py), so when
chunk i's attention backward runs, every later chunk has already added its dK/dV for chunk i's rows: they
are added to the gradient chunk i's own attention gives its k and v, and flow on into its projections.
Chunk i's backward adds its dK/dV for the earlier chunks' rows to the store.

The store is read through ctx attributes, not save_for_backward: each later chunk writes its own rows into
the same buffers in place, which autograd's version check would refuse for a saved view although the rows
a chunk reads never change. A chunk forwarded again (recomputed, or by activation checkpointing) writes
the same values again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.attention.index import VarlenBlock
from workers.attention.kernels import VarlenKernel
from workers.attention.ring import merge_lse


class ChunkKV:
    """Per layer: one sequence's K and V [S, G, D] (model dtype) and their gradients (fp32), allocated on
    the first write (module docstring)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grad: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer: int, start: int, k_CGD: torch.Tensor, v_CGD: torch.Tensor) -> None:
        """Store rows [start, start + c) of `layer`'s K and V (detached)."""
        if layer not in self._kv:
            shape = (self.length, *k_CGD.shape[1:])
            self._kv[layer] = (k_CGD.new_empty(shape), v_CGD.new_empty(shape))
            self._grad[layer] = (k_CGD.new_zeros(shape, dtype=torch.float32),
                                 v_CGD.new_zeros(shape, dtype=torch.float32))
        keys, values = self._kv[layer]
        stop = start + k_CGD.shape[0]
        keys[start:stop] = k_CGD.detach()
        values[start:stop] = v_CGD.detach()

    def prior(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of rows [0, start): the earlier chunks' (views)."""
        keys, values = self._kv[layer]
        return keys[:start], values[:start]

    def add_grad(self, layer: int, dk_PGD: torch.Tensor, dv_PGD: torch.Tensor) -> None:
        """Accumulate a later chunk's gradient for rows [0, P) of `layer`'s K and V."""
        dkeys, dvalues = self._grad[layer]
        rows = dk_PGD.shape[0]
        dkeys[:rows] += dk_PGD
        dvalues[:rows] += dv_PGD

    def grad(self, layer: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The accumulated gradient of rows [start, stop) of `layer`'s K and V (fp32 views)."""
        dkeys, dvalues = self._grad[layer]
        return dkeys[start:stop], dvalues[start:stop]

    @property
    def nbytes(self) -> int:
        """Bytes held: every layer's K, V and their fp32 gradients."""
        return sum(t.nbytes for pair in (*self._kv.values(), *self._grad.values()) for t in pair)


@dataclass(frozen=True, slots=True, eq=False)
class ChunkCall:
    """What one dependent chunk's attention calls read (passed as the `dacp_chunk` keyword to the model)."""

    store: ChunkKV
    start: int
    """s: the chunk's first token in its sequence, i.e. the earlier chunks' key count."""
    stop: int
    prior: VarlenBlock | None
    """The full block of the chunk's c queries against the s prior keys (None for chunk 0)."""


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_CHD, k_CGD, v_CGD, call, layer, kernel, diag, scale):
        call.store.write(layer, call.start, k_CGD, v_CGD)
        out, lse = kernel.forward(q_CHD, k_CGD, v_CGD, diag, scale=scale)
        if call.prior is not None:
            prior_k, prior_v = call.store.prior(layer, call.start)
            out_p, lse_p = kernel.forward(q_CHD, prior_k, prior_v, call.prior, scale=scale)
            out, lse = merge_lse(out.float(), lse, out_p, lse_p)
            out = out.to(q_CHD.dtype)
        ctx.save_for_backward(q_CHD, k_CGD, v_CGD, out, lse)
        ctx.setup = (call, layer, kernel, diag, scale)
        return out

    @staticmethod
    def backward(ctx, dout_CHD):
        q, k, v, out, lse = ctx.saved_tensors
        call, layer, kernel, diag, scale = ctx.setup
        dout_CHD = dout_CHD.contiguous()
        # Both blocks' backward take the merged out and lse (kernels.py): each block's gradient is exact.
        dq, dk, dv = kernel.backward(dout_CHD, q, k, v, out, lse, diag, scale=scale)
        if call.prior is not None:
            prior_k, prior_v = call.store.prior(layer, call.start)
            dq_p, dk_p, dv_p = kernel.backward(dout_CHD, q, prior_k, prior_v, out, lse, call.prior,
                                               scale=scale)
            dq = dq + dq_p
            call.store.add_grad(layer, dk_p, dv_p)
        later_dk, later_dv = call.store.grad(layer, call.start, call.stop)  # complete: later chunks ran first
        dk = (dk.float() + later_dk).to(k.dtype)
        dv = (dv.float() + later_dv).to(v.dtype)
        return dq, dk, dv, None, None, None, None, None


def chunk_attention(q_CHD: torch.Tensor, k_CGD: torch.Tensor, v_CGD: torch.Tensor, call: ChunkCall, *,
                    layer: int, kernel: VarlenKernel, diag: VarlenBlock, scale: float) -> torch.Tensor:
    """out [c, H, D] of one dependent chunk's queries over its sequence's keys [0, stop) (module docstring).

    q [c, H, D]; k, v [c, G, D] (the chunk's own, post-RoPE); `layer` keys the store; `diag` is the causal
    block of the chunk's own tokens (its DacpIndex.local). Differentiable in q, k, v.
    """
    if k_CGD.shape[0] != call.stop - call.start:
        raise ValueError(f"a chunk of {k_CGD.shape[0]} tokens, but its span is [{call.start}, {call.stop})")
    return _ChunkAttention.apply(q_CHD, k_CGD, v_CGD, call, layer, kernel, diag, scale)
