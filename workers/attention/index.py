"""Everything one micro-batch's attention reads, built once on the host and moved to the device in one go.

    DacpLayout (host ints) --DacpIndex.build(layout, device)--> DacpIndex
        local   : VarlenBlock(cu_local x cu_local, causal)   the local sequences, whole
        diag    : VarlenBlock(cu_dist  x cu_dist,  causal)   ring step 0: my shards x my shards
        kfirst  : VarlenBlock(cu_dist  x cu_chunk)           ring steps whose source rank is lower
        qsecond : VarlenBlock(cu_chunk x cu_dist)            ring steps whose source rank is higher
        first, second : int64 rows of the distributed part holding each sequence's first / second chunk

Every cu_seqlens of the micro-batch lives in one int32 host tensor and both row indices in one int64 host
tensor; each is copied to the device once, pinned and non-blocking on CUDA (workers/transfer.py), and the
blocks hold views into the copies. Every layer's attention, forward and backward (and the recompute of
activation checkpointing), reads these same tensors, so no attention call builds a tensor from host data
or waits for a copy. Max lengths and per-segment spans are Python ints computed here with them: the CUDA
kernels take max_seqlen as an int, and the CPU kernel runs one op per segment over the spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.attention.layout import DacpLayout
from workers.transfer import to_device

Span = tuple[int, int, int, int]


def segment_spans(cu_q: Sequence[int], cu_k: Sequence[int], causal: bool) -> tuple[Span, ...]:
    """Non-empty (q_start, q_end, k_start, k_end) segments; a segment without keys contributes nothing."""
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_q has {len(cu_q)} entries, cu_k {len(cu_k)}")
    spans = []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if causal and q1 - q0 != k1 - k0:
            raise ValueError("causal varlen blocks must be square (len_q == len_k per segment)")
        if q1 > q0 and k1 > k0:
            spans.append((q0, q1, k0, k1))
    return tuple(spans)


def _longest(cu: Sequence[int]) -> int:
    return max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=0)


@dataclass(frozen=True, slots=True, eq=False)
class VarlenBlock:
    """One varlen attention call's segments: segment i's queries attend to segment i's keys only."""

    cu_q: torch.Tensor
    """[B + 1] int32 query segment bounds, on the compute device."""
    cu_k: torch.Tensor
    """[B + 1] int32 key segment bounds, on the compute device."""
    max_q: int
    """Longest query segment."""
    max_k: int
    """Longest key segment."""
    causal: bool
    """Causal (square segments, diagonal blocks) or full attention."""
    spans: tuple[Span, ...]
    """The non-empty segments as host ints, for kernels that run one op per segment (the CPU one)."""

    @classmethod
    def of(cls, cu_q: Sequence[int], cu_k: Sequence[int], cu_q_dev: torch.Tensor, cu_k_dev: torch.Tensor,
           *, causal: bool) -> VarlenBlock:
        """A block from host bounds and their device copies (already moved)."""
        return cls(cu_q=cu_q_dev, cu_k=cu_k_dev, max_q=_longest(cu_q), max_k=_longest(cu_k), causal=causal,
                   spans=segment_spans(cu_q, cu_k, causal))

    @classmethod
    def build(cls, cu_q: Sequence[int], cu_k: Sequence[int], *, causal: bool,
              device: torch.device | str = "cpu") -> VarlenBlock:
        """A standalone block with its own host->device copy: one-off kernel calls and tests."""
        cu_q, cu_k = tuple(int(x) for x in cu_q), tuple(int(x) for x in cu_k)
        both = to_device(torch.tensor([*cu_q, *cu_k], dtype=torch.int32), device)
        q_dev, k_dev = torch.split(both, [len(cu_q), len(cu_k)])
        return cls.of(cu_q, cu_k, q_dev, k_dev, causal=causal)


def _half_rows(layout: DacpLayout) -> np.ndarray:
    """Rows of the distributed part holding each sequence's first chunk, then those of its second."""
    starts, chunks = layout.cu_dist[:-1], layout.dist_chunk_lens
    if not chunks:
        return np.zeros(0, dtype=np.int64)
    first = [np.arange(s, s + c, dtype=np.int64) for s, c in zip(starts, chunks, strict=True)]
    second = [np.arange(s + c, s + 2 * c, dtype=np.int64) for s, c in zip(starts, chunks, strict=True)]
    return np.concatenate(first + second)


@dataclass(frozen=True, slots=True, eq=False)
class DacpIndex:
    """A DacpLayout's device-side index: what every attention call of one micro-batch reads."""

    layout: DacpLayout
    device: torch.device
    local: VarlenBlock
    diag: VarlenBlock
    kfirst: VarlenBlock
    qsecond: VarlenBlock
    first: torch.Tensor
    """[sum c_i] int64 rows of the distributed part: every sequence's first chunk."""
    second: torch.Tensor
    """[sum c_i] int64 rows of the distributed part: every sequence's second chunk."""

    @classmethod
    def build(cls, layout: DacpLayout, device: torch.device | str) -> DacpIndex:
        """Two host tensors (int32 bounds, int64 rows), two copies to `device`; the rest are views."""
        bounds = (layout.cu_local, layout.cu_dist, layout.cu_chunk)
        flat = torch.tensor([x for cu in bounds for x in cu], dtype=torch.int32)
        local_t, dist_t, chunk_t = torch.split(to_device(flat, device), [len(cu) for cu in bounds])
        rows = to_device(torch.from_numpy(_half_rows(layout)), device)
        first, second = torch.split(rows, [rows.shape[0] // 2] * 2)
        cu_local, cu_dist, cu_chunk = bounds
        return cls(
            layout=layout, device=local_t.device,
            local=VarlenBlock.of(cu_local, cu_local, local_t, local_t, causal=True),
            diag=VarlenBlock.of(cu_dist, cu_dist, dist_t, dist_t, causal=True),
            kfirst=VarlenBlock.of(cu_dist, cu_chunk, dist_t, chunk_t, causal=False),
            qsecond=VarlenBlock.of(cu_chunk, cu_dist, chunk_t, dist_t, causal=False),
            first=first, second=second,
        )
