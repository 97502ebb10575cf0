"""Everything one micro-batch's attention reads, built once on the host and moved to the device in one go.

    DacpLayout (host ints) --DacpIndex.build(layout, device)--> DacpIndex
        local   : VarlenBlock(cu_local x cu_local, causal)   the local sequences, whole
        rings   : one RingIndex per ring part (the distributed part, then each partial degree):
          diag    : VarlenBlock(cu x cu,  causal)            ring step 0: my shards x my shards
          kfirst  : VarlenBlock(cu x cu_chunk)               ring steps whose source rank is lower
          qsecond : VarlenBlock(cu_chunk x cu)               ring steps whose source rank is higher
          first, second : int64 rows of the part holding each sequence's first / second chunk

Every cu_seqlens of the micro-batch (every part) lives in one int32 host tensor and every part's row
indices in one int64 host tensor; each is copied to the device once, pinned and non-blocking on CUDA
(workers/transfer.py), and the blocks hold views into the copies. Every layer's attention, forward and
backward (and the recompute of activation checkpointing), reads these same tensors, so no attention call
builds a tensor from host data or waits for a copy. Max lengths and per-segment spans are Python ints
computed here with them: the CUDA kernels take max_seqlen as an int, and the CPU kernel runs one op per
segment over the spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.attention.layout import DacpLayout, RingPart
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


def _half_rows(part: RingPart) -> np.ndarray:
    """Rows of a ring part (relative to its start) holding each sequence's first chunk, then its second."""
    starts, chunks = part.cu[:-1], part.chunk_lens
    if not chunks:
        return np.zeros(0, dtype=np.int64)
    first = [np.arange(s, s + c, dtype=np.int64) for s, c in zip(starts, chunks, strict=True)]
    second = [np.arange(s + c, s + 2 * c, dtype=np.int64) for s, c in zip(starts, chunks, strict=True)]
    return np.concatenate(first + second)


@dataclass(frozen=True, slots=True, eq=False)
class RingIndex:
    """One ring part's device-side index: the three kinds of ring block and the zigzag chunk rows."""

    degree: int
    """The ranks of its ring (its RingPart's degree)."""
    start: int
    """First stream row of the part."""
    stop: int
    """One past its last stream row."""
    diag: VarlenBlock
    kfirst: VarlenBlock
    qsecond: VarlenBlock
    first: torch.Tensor
    """[sum c_i] int64 rows of the part (relative to its start): every sequence's first chunk."""
    second: torch.Tensor
    """[sum c_i] int64 rows of the part: every sequence's second chunk."""

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True, eq=False)
class DacpIndex:
    """A DacpLayout's device-side index: what every attention call of one micro-batch reads."""

    layout: DacpLayout
    device: torch.device
    local: VarlenBlock
    rings: tuple[RingIndex, ...]
    """One per layout.rings: the distributed part first (always present, maybe empty), then the partial."""

    @property
    def dist(self) -> RingIndex:
        """The distributed part's (degree N) index."""
        return self.rings[0]

    # The distributed part's blocks under their names from before per-sequence degrees existed.
    @property
    def diag(self) -> VarlenBlock:
        return self.dist.diag

    @property
    def kfirst(self) -> VarlenBlock:
        return self.dist.kfirst

    @property
    def qsecond(self) -> VarlenBlock:
        return self.dist.qsecond

    @property
    def first(self) -> torch.Tensor:
        return self.dist.first

    @property
    def second(self) -> torch.Tensor:
        return self.dist.second

    @classmethod
    def build(cls, layout: DacpLayout, device: torch.device | str) -> DacpIndex:
        """Two host tensors (int32 bounds of every block of every part, int64 chunk rows of every ring
        part), two copies to `device`; every block and row tensor is a view into them."""
        parts = layout.rings
        bounds = [layout.cu_local] + [cu for part in parts for cu in (part.cu, part.cu_chunk)]
        flat = torch.tensor([x for cu in bounds for x in cu], dtype=torch.int32)
        bounds_dev = torch.split(to_device(flat, device), [len(cu) for cu in bounds])
        halves = [_half_rows(part) for part in parts]
        rows = to_device(torch.from_numpy(np.concatenate(halves)), device)
        row_views = torch.split(rows, [n // 2 for h in halves for n in (h.size, h.size)])
        local_t = bounds_dev[0]
        rings, start = [], layout.num_local_tokens
        for i, part in enumerate(parts):
            cu, cu_chunk = part.cu, part.cu_chunk
            cu_t, chunk_t = bounds_dev[1 + 2 * i], bounds_dev[2 + 2 * i]
            rings.append(RingIndex(
                degree=part.degree, start=start, stop=start + part.num_tokens,
                diag=VarlenBlock.of(cu, cu, cu_t, cu_t, causal=True),
                kfirst=VarlenBlock.of(cu, cu_chunk, cu_t, chunk_t, causal=False),
                qsecond=VarlenBlock.of(cu_chunk, cu, chunk_t, cu_t, causal=False),
                first=row_views[2 * i], second=row_views[2 * i + 1],
            ))
            start += part.num_tokens
        return cls(layout=layout, device=local_t.device,
                   local=VarlenBlock.of(layout.cu_local, layout.cu_local, local_t, local_t, causal=True),
                   rings=tuple(rings))
