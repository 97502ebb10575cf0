"""Zigzag ring attention over the ring parts of a DACP stream: forward and backward, as step generators.

A ring part (workers/attention/layout.py) holds this rank's shards of the sequences sharded over one ring
of N ranks: the whole CP group (the distributed part), or an aligned subgroup of d ranks (a partial part;
there N below is d and r the rank's index inside the subgroup). Rank r holds, for every sequence of the
part, chunks r and 2N-1-r ("first" and "second" half below). At ring step j it holds the K/V of source rank
s = (r - j) mod N. By chunk order, for every sequence:

    step 0 (s == r): all my queries x all my keys, causal (the two chunks are in position order)
    s < r          : all my queries x the source's FIRST chunks, full (its second chunks lie after mine)
    s > r          : my SECOND chunks' queries x all the source's keys, full (my first chunk sees none)

so a block is a plain varlen call (causal-diagonal, full, or skipped), and partial results are merged
in fp32 by log-sum-exp. The next K/V block is in flight while the current one is computed.

Backward: the same K/V ring runs again, plus a second ring that carries each source's fp32 dK/dV
accumulator one hop behind; after N hops every accumulator is back at its owner.
K/V travel with G (KV) heads: GQA shrinks the traffic by H/G.

Concurrency. `ring_forward_steps` / `ring_backward_steps` are generators: each `yield` comes right after
the ring posted a transfer and before it blocks on one, so whatever the caller runs between two `next()`
calls (another ring's step, the local attention) hides that transfer. `run_rings` drives several rings of
one micro-batch round-robin: round 0 posts every ring's first transfer, then the `overlap` callback (DACP's
local attention) runs, then round j runs step j of every ring in plan order (wait, post the next
transfer, compute). Rings of different process groups thus overlap each other and the local work, and
nothing serializes them globally. Deadlock-free: a wait of round j needs only the ring peers' posts of
round j - 1, and every rank finishes its round j - 1 before its round j, whatever rings it holds.

Which rows and segments each block uses comes from the part's RingIndex (workers/attention/index.py), built
once before the first layer: nothing here builds an index tensor or reads a device value.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import TypeVar

import torch

from workers.attention.comm import RingComm
from workers.attention.index import RingIndex, VarlenBlock
from workers.attention.kernels import VarlenKernel

KV_TAG, DKV_TAG = 7, 8

T = TypeVar("T")
Steps = Generator[None, None, T]
"""A ring run as a generator: yields while its transfers are in flight, returns its result."""


def merge_lse(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two partial softmax results (fp32). out [T,H,D], lse [H,T]; -inf = empty."""
    lse_new = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(torch.isinf(lse_new), torch.zeros_like(lse_new), lse_new)
    w_acc = torch.exp(lse_acc - safe).T.unsqueeze(-1)
    w_blk = torch.exp(lse_blk - safe).T.unsqueeze(-1)
    return out_acc * w_acc + out_blk.float() * w_blk, lse_new


def _block(ring: RingIndex, rank: int, source: int) -> tuple[str, VarlenBlock]:
    """Which queries meet which keys at this ring step: ('diag'|'kfirst'|'qsecond', its segments)."""
    if source == rank:
        return "diag", ring.diag
    if source < rank:
        return "kfirst", ring.kfirst
    return "qsecond", ring.qsecond


def _place(comm: RingComm | None, ring: RingIndex) -> tuple[int, int]:
    """(ring size, this rank's index in it); the communicator must span exactly the part's degree."""
    size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    if size != ring.degree:
        raise ValueError(f"a degree-{ring.degree} ring part was given a {size}-rank ring communicator")
    return size, rank


def ring_forward_steps(
    kernel: VarlenKernel, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
    ring: RingIndex, comm: RingComm | None, scale: float,
) -> Steps[tuple[torch.Tensor, torch.Tensor]]:
    """Attention of this rank's shards of one ring part, step by step (module docstring); returns
    (out [T,H,D] in q's dtype, lse [H,T] fp32)."""
    size, rank = _place(comm, ring)
    first, second = ring.first, ring.second
    kv = torch.stack([k_KGD, v_KGD])
    pending = comm.start(kv, KV_TAG) if size > 1 else None
    yield  # the first K/V transfer is in flight: the local attention and the other rings' posts run now
    out_acc, lse_acc = kernel.forward(q_THD, k_KGD, v_KGD, ring.diag, scale=scale)
    out_acc = out_acc.float()
    for step in range(1, size):
        yield  # before blocking on this step's K/V: the other rings compute meanwhile
        kv = comm.wait(pending)
        pending = comm.start(kv, KV_TAG) if step + 1 < size else None
        kind, block = _block(ring, rank, (rank - step) % size)
        if kind == "kfirst":
            o, lse = kernel.forward(q_THD, kv[0][first], kv[1][first], block, scale=scale)
            out_acc, lse_acc = merge_lse(out_acc, lse_acc, o, lse)
        else:
            o, lse = kernel.forward(q_THD[second], kv[0], kv[1], block, scale=scale)
            out_acc[second], lse_acc[:, second] = merge_lse(out_acc[second], lse_acc[:, second], o, lse)
    return out_acc.to(q_THD.dtype), lse_acc


def ring_backward_steps(
    kernel: VarlenKernel, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
    v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor, ring: RingIndex,
    comm: RingComm | None, scale: float,
) -> Steps[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Gradients (dq, dk, dv) of one ring part from the final (merged) out and lse, step by step."""
    size, rank = _place(comm, ring)
    first, second = ring.first, ring.second
    dq_acc = torch.zeros(q_THD.shape, dtype=torch.float32, device=q_THD.device)
    kv = torch.stack([k_KGD, v_KGD])
    dkv_acc: torch.Tensor | None = None
    dkv_pending = None
    kv_pending = comm.start(kv, KV_TAG) if size > 1 else None
    yield  # the first K/V transfer is in flight: the local backward and the other rings' posts run now
    for step in range(size):
        if step:
            yield  # before blocking on this step's K/V
            kv = comm.wait(kv_pending)
            kv_pending = comm.start(kv, KV_TAG) if step + 1 < size else None
        kind, block = _block(ring, rank, (rank - step) % size)
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
    if dkv_pending is not None:
        yield  # the last hop brings my own accumulator home: the other rings compute meanwhile
    dkv_own = comm.wait(dkv_pending) if dkv_pending is not None else dkv_acc
    return dq_acc.to(q_THD.dtype), dkv_own[0].to(k_KGD.dtype), dkv_own[1].to(v_KGD.dtype)


def run_rings(rings: Sequence[Steps[T]], overlap: Callable[[], None] | None = None, *,
              concurrent: bool = True) -> list[T]:
    """Drive step generators to completion; their results in order.

    concurrent: round 0 advances every ring to its first yield (first transfers posted), then `overlap`
    runs, then round-robin one step of each unfinished ring per round (module docstring). Not concurrent:
    `overlap` first, then each ring alone to completion in order (the serialized comparison of
    `bench attention`; deadlock-free too, since every rank meets its rings in the same plan order).
    """
    results: list = [None] * len(rings)
    if not concurrent:
        if overlap is not None:
            overlap()
        for i, ring in enumerate(rings):
            results[i] = _finish(ring)
        return results
    active = _advance(rings, list(range(len(rings))), results)  # round 0: every first transfer posted
    if overlap is not None:
        overlap()
    while active:
        active = _advance(rings, active, results)
    return results


def _advance(rings: Sequence[Steps], active: list[int], results: list) -> list[int]:
    """One round: advance each active ring to its next yield; those that returned store their result."""
    still = []
    for i in active:
        try:
            next(rings[i])
            still.append(i)
        except StopIteration as done:
            results[i] = done.value
    return still


def _finish(ring: Steps[T]) -> T:
    while True:
        try:
            next(ring)
        except StopIteration as done:
            return done.value


def ring_forward(
    kernel: VarlenKernel, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
    ring: RingIndex, comm: RingComm | None, scale: float, overlap: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring part's forward alone; `overlap` runs while its first transfer is in flight."""
    return run_rings([ring_forward_steps(kernel, q_THD, k_KGD, v_KGD, ring, comm, scale)], overlap)[0]


def ring_backward(
    kernel: VarlenKernel, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
    v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor, ring: RingIndex,
    comm: RingComm | None, scale: float, overlap: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ring part's backward alone; `overlap` runs while its first transfer is in flight."""
    steps = ring_backward_steps(kernel, dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, ring, comm, scale)
    return run_rings([steps], overlap)[0]
