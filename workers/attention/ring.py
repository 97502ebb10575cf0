"""Zigzag ring attention over the distributed part of a DACP stream: forward and backward.

Rank r holds, for every distributed sequence, chunks r and 2N-1-r ("first" and "second" half below).
At ring step j it holds the K/V of source rank s = (r - j) mod N. By chunk order, for every sequence:

    step 0 (s == r): all my queries x all my keys, causal (the two chunks are in position order)
    s < r          : all my queries x the source's FIRST chunks, full (its second chunks lie after mine)
    s > r          : my SECOND chunks' queries x all the source's keys, full (my first chunk sees none)

so a block is a plain varlen call (causal-diagonal, full, or skipped), and partial results are merged
in fp32 by log-sum-exp. The next K/V block is in flight while the current one is computed; the
`overlap` callback (DACP's local attention) runs while the very first transfer is in flight.

Backward: the same K/V ring runs again, plus a second ring that carries each source's fp32 dK/dV
accumulator one hop behind; after N hops every accumulator is back at its owner.
K/V travel with G (KV) heads: GQA shrinks the traffic by H/G.

Which rows and segments each block uses comes from the micro-batch's DacpIndex (workers/attention/index.py),
built once before the first layer: nothing here builds an index tensor or reads a device value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.attention.comm import RingComm
from workers.attention.index import DacpIndex, VarlenBlock
from workers.attention.kernels import VarlenKernel

KV_TAG, DKV_TAG = 7, 8


def merge_lse(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two partial softmax results (fp32). out [T,H,D], lse [H,T]; -inf = empty."""
    lse_new = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(torch.isinf(lse_new), torch.zeros_like(lse_new), lse_new)
    w_acc = torch.exp(lse_acc - safe).T.unsqueeze(-1)
    w_blk = torch.exp(lse_blk - safe).T.unsqueeze(-1)
    return out_acc * w_acc + out_blk.float() * w_blk, lse_new


def _block(index: DacpIndex, rank: int, source: int) -> tuple[str, VarlenBlock]:
    """Which queries meet which keys at this ring step: ('diag'|'kfirst'|'qsecond', its segments)."""
    if source == rank:
        return "diag", index.diag
    if source < rank:
        return "kfirst", index.kfirst
    return "qsecond", index.qsecond


def ring_forward(
    kernel: VarlenKernel, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
    index: DacpIndex, comm: RingComm | None, scale: float, overlap: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's distributed shards; returns (out [T,H,D] in q's dtype, lse [H,T] fp32)."""
    size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    first, second = index.first, index.second
    kv = torch.stack([k_KGD, v_KGD])
    pending = comm.start(kv, KV_TAG) if size > 1 else None
    if overlap is not None:
        overlap()
    out_acc, lse_acc = kernel.forward(q_THD, k_KGD, v_KGD, index.diag, scale=scale)
    out_acc = out_acc.float()
    for step in range(1, size):
        kv = comm.wait(pending)
        pending = comm.start(kv, KV_TAG) if step + 1 < size else None
        kind, block = _block(index, rank, (rank - step) % size)
        if kind == "kfirst":
            o, lse = kernel.forward(q_THD, kv[0][first], kv[1][first], block, scale=scale)
            out_acc, lse_acc = merge_lse(out_acc, lse_acc, o, lse)
        else:
            o, lse = kernel.forward(q_THD[second], kv[0], kv[1], block, scale=scale)
            out_acc[second], lse_acc[:, second] = merge_lse(out_acc[second], lse_acc[:, second], o, lse)
    return out_acc.to(q_THD.dtype), lse_acc


def ring_backward(
    kernel: VarlenKernel, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
    v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor, index: DacpIndex,
    comm: RingComm | None, scale: float, overlap: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of the distributed part, from the final (merged) out and lse."""
    size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    first, second = index.first, index.second
    dq_acc = torch.zeros(q_THD.shape, dtype=torch.float32, device=q_THD.device)
    kv = torch.stack([k_KGD, v_KGD])
    dkv_acc: torch.Tensor | None = None
    dkv_pending = None
    for step in range(size):
        kv_pending = comm.start(kv, KV_TAG) if step + 1 < size else None
        if step == 0 and overlap is not None:
            overlap()
        kind, block = _block(index, rank, (rank - step) % size)
        dkv_blk = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        if kind == "diag":
            dq, dk, dv = kernel.backward(dout_THD, q_THD, kv[0], kv[1], out_THD, lse_HT, block, scale=scale)
            dq_acc += dq
            dkv_blk[0], dkv_blk[1] = dk, dv
        elif kind == "kfirst":
            dq, dk, dv = kernel.backward(dout_THD, q_THD, kv[0][first], kv[1][first], out_THD, lse_HT,
                                         block, scale=scale)
            dq_acc += dq
            dkv_blk[0, first], dkv_blk[1, first] = dk.float(), dv.float()
        else:
            dq, dk, dv = kernel.backward(dout_THD[second], q_THD[second], kv[0], kv[1], out_THD[second],
                                         lse_HT[:, second], block, scale=scale)
            dq_acc[second] += dq
            dkv_blk[0], dkv_blk[1] = dk, dv
        # The accumulator for this step's source arrived from the previous rank one hop ago.
        dkv_acc = dkv_blk if dkv_pending is None else comm.wait(dkv_pending) + dkv_blk
        if size > 1:
            dkv_pending = comm.start(dkv_acc, DKV_TAG)
        if kv_pending is not None:
            kv = comm.wait(kv_pending)
    dkv_own = comm.wait(dkv_pending) if dkv_pending is not None else dkv_acc
    return dq_acc.to(q_THD.dtype), dkv_own[0].to(k_KGD.dtype), dkv_own[1].to(v_KGD.dtype)
