"""Build one CP rank's packed token stream from a DACP plan.

For CP rank r of N, a plan with local[r] = (a, b) and distributed = (d,), S_d = 10, N = 2
(2N = 4 chunks, S_d padded to 12, c = 3; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2):

    rank 0:  [ a a a a | b b | d0 d1 d2 | d9 P P ]      P = pad (token 0, target -100)
    rank 1:  [ ...its locals... | d3 d4 d5 | d6 d7 d8 ]
    position_ids: true positions inside each sequence (a: 0..3, b: 0..1, d: 0 1 2 9 10 11 on rank 0),
    so RoPE is right for shards; pads continue the count past S_d.
    targets: the HF labels shifted left by one on the WHOLE sequence before it is cut (d2's target is
    d3's label, held by rank 1), -100 on every sequence's last token and on pads.

Per-sequence CP degrees (docs/design.md §13): after the distributed shards come, for each entry of
`plan.partial_on(r)` in plan order (degree descending), the rank's zigzag shards of that entry's sequences
over its aligned subgroup of d ranks [g*d, (g+1)*d), with j = r - g*d the rank's index inside it:
a sequence is padded to a multiple of 2d, cut into 2d chunks, and rank j holds chunks j and 2d-1-j.
With N = 4, a degree-2 entry of group 1 holding e (S_e = 7, padded 8, c = 2):

    rank 2:  [ ...locals... | ...distributed shards... | e0 e1 | e6 P ]      (j = 0: chunks 0 and 3)
    rank 3:  [ ...locals... | ...distributed shards... | e2 e3 | e4 e5 ]     (j = 1: chunks 1 and 2)

A dependent chunk (the chunkflow policy: `plan.chunk_on(r)` is a ChunkSpan [s, s + c) of the rank's one
local sequence) is the stream of those c tokens at their true positions s.., with the targets of the
whole sequence's shift (the chunk's last target is the next chunk's first label); `to(device)` also builds
the full block of its c queries against the s earlier keys (`prior`, workers/attention/chunked.py).

`seq_index` / `position_ids` are the inverse mapping: stream token t is token position_ids[t] of the
caller's sequence seq_index[t] (-1 for pads); tests use it to scatter results back.

Built on the host; `RankBatch.to(device)` moves it once per micro-batch (pinned, non-blocking on CUDA) and
indexes its layout there (`index`, workers/attention/index.py), so the step's hot path never builds a
tensor from host data: every attention layer reads `index`, the loss reads `label_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from scheduling.payload import IGNORE_INDEX
from workers.attention.index import DacpIndex, VarlenBlock
from workers.attention.layout import DacpLayout, RingPart
from workers.transfer import to_device


class PlanLike(Protocol):
    """What batch assembly needs of a plan (scheduling.DacpPlan satisfies it; a plan without `partial_on`
    has no subgroup-sharded sequences)."""

    local: tuple[tuple[int, ...], ...]
    distributed: tuple[int, ...]


class ChunkLike(Protocol):
    """A dependent chunk's span (scheduling.ChunkSpan satisfies it)."""

    chunk: int
    num_chunks: int
    start: int
    stop: int
    recompute: bool


class SubgroupLike(Protocol):
    """One entry of a plan's `partial_on(cp_rank)` (scheduling.SubgroupShards satisfies it)."""

    degree: int
    group: int
    indices: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankBatch:
    input_ids: torch.Tensor
    """[T] int64 token ids of this rank's stream."""
    position_ids: torch.Tensor
    """[T] int64 true position of each token inside its sequence."""
    targets: torch.Tensor
    """[T] int64 next-token target of each token (-100: no loss)."""
    seq_index: torch.Tensor
    """[T] int64 index of each token's sequence in the caller's list (-1: pad)."""
    label_rows: torch.Tensor
    """[num_label_tokens] int64 stream rows with a target, ascending (the loss reads only these)."""
    layout: DacpLayout
    num_label_tokens: int
    """Tokens of this rank with a target (targets != -100)."""
    index: DacpIndex | None = None
    """The layout's device index, built by `to(device)`: what every attention call reads."""
    chunk: ChunkLike | None = None
    """The span when this stream is one dependent chunk of a sequence (module docstring)."""
    prior: VarlenBlock | None = None
    """A chunk's queries x its sequence's earlier keys (full block), built by `to(device)`; None for
    chunk 0 and for every stream that is not a chunk."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> RankBatch:
        """This batch on `device`, its layout indexed there; the same batch if it is there already."""
        ids = to_device(self.input_ids, device)
        if self.index is not None and self.index.device == ids.device:
            return self
        return replace(self, input_ids=ids, position_ids=to_device(self.position_ids, device),
                       targets=to_device(self.targets, device), seq_index=to_device(self.seq_index, device),
                       label_rows=to_device(self.label_rows, device),
                       index=DacpIndex.build(self.layout, ids.device), prior=self._prior(ids.device))

    def _prior(self, device: torch.device) -> VarlenBlock | None:
        """A chunk's queries x its sequence's earlier keys: one full segment (None: no earlier keys)."""
        if self.chunk is None or not self.chunk.start:
            return None
        return VarlenBlock.build((0, self.num_tokens), (0, self.chunk.start), causal=False, device=device)


def padded_length(length: int, cp_size: int) -> int:
    """A sequence sharded over `cp_size` ranks (N for a distributed one, d for a subgroup's) is padded to a
    multiple of 2 * cp_size (at least that: one token per chunk)."""
    chunks = 2 * cp_size
    return max(chunks, -(-length // chunks) * chunks)


def shifted_targets(labels: np.ndarray) -> np.ndarray:
    """targets[t] = labels[t + 1] (HF causal-LM convention), -100 for the last token."""
    out = np.full(labels.shape, IGNORE_INDEX, dtype=np.int64)
    out[:-1] = labels[1:]
    return out


def _sequence(input_ids: Sequence, labels: Sequence, index: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(input_ids[index], dtype=np.int64).reshape(-1)
    lab = np.asarray(labels[index], dtype=np.int64).reshape(-1)
    if ids.shape != lab.shape:
        raise ValueError(f"sequence {index}: {ids.size} input_ids but {lab.size} labels (must be equal)")
    if ids.size == 0:
        raise ValueError(f"sequence {index} is empty; drop empty samples before planning")
    return ids, lab


def _shard(index: int, ids: np.ndarray, lab: np.ndarray, cp_rank: int, cp_size: int) -> tuple[list, int]:
    """Ring rank cp_rank's two zigzag chunks of one sequence sharded over cp_size ranks, as 4 column arrays
    (for a subgroup: its index inside the subgroup and the subgroup's degree)."""
    padded = padded_length(ids.size, cp_size)
    chunk = padded // (2 * cp_size)
    full_ids = np.zeros(padded, dtype=np.int64)
    full_ids[: ids.size] = ids
    full_tgt = np.full(padded, IGNORE_INDEX, dtype=np.int64)
    full_tgt[: ids.size] = shifted_targets(lab)
    full_seq = np.full(padded, -1, dtype=np.int64)
    full_seq[: ids.size] = index
    pos = np.arange(padded, dtype=np.int64)
    take = np.concatenate([pos[cp_rank * chunk:(cp_rank + 1) * chunk],
                           pos[(2 * cp_size - 1 - cp_rank) * chunk:(2 * cp_size - cp_rank) * chunk]])
    return [full_ids[take], pos[take], full_tgt[take], full_seq[take]], chunk


def build_rank_batch(
    plan: PlanLike, input_ids: Sequence, labels: Sequence, *, cp_rank: int, cp_size: int
) -> RankBatch:
    """This CP rank's stream: its local sequences whole, its zigzag shards of the distributed ones, then
    of each subgroup entry that holds it (module docstring)."""
    if len(plan.local) != cp_size:
        raise ValueError(f"plan has {len(plan.local)} CP ranks but cp_size={cp_size} (parallel.cp_size)")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside [0, {cp_size})")
    chunk_on = getattr(plan, "chunk_on", None)
    span: ChunkLike | None = chunk_on(cp_rank) if chunk_on is not None else None
    if span is not None:
        return _chunk_batch(plan.local[cp_rank], span, input_ids, labels, cp_size)
    partial_on = getattr(plan, "partial_on", None)
    entries: tuple[SubgroupLike, ...] = partial_on(cp_rank) if partial_on is not None else ()
    columns: list[list[np.ndarray]] = [[], [], [], []]
    local_lens, chunk_lens = [], []
    for index in plan.local[cp_rank]:
        ids, lab = _sequence(input_ids, labels, index)
        parts = [ids, np.arange(ids.size, dtype=np.int64), shifted_targets(lab),
                 np.full(ids.size, index, dtype=np.int64)]
        for col, part in zip(columns, parts, strict=True):
            col.append(part)
        local_lens.append(ids.size)
    for index in plan.distributed:
        ids, lab = _sequence(input_ids, labels, index)
        parts, chunk = _shard(index, ids, lab, cp_rank, cp_size)
        for col, part in zip(columns, parts, strict=True):
            col.append(part)
        chunk_lens.append(chunk)
    partial = []
    for entry in entries:
        if not 1 < entry.degree < cp_size or cp_size % entry.degree:
            raise ValueError(f"plan shards over {entry.degree} of {cp_size} CP ranks: not a CP subgroup")
        sub_rank, entry_chunks = cp_rank - entry.group * entry.degree, []
        for index in entry.indices:
            ids, lab = _sequence(input_ids, labels, index)
            parts, chunk = _shard(index, ids, lab, sub_rank, entry.degree)
            for col, part in zip(columns, parts, strict=True):
                col.append(part)
            entry_chunks.append(chunk)
        partial.append(RingPart(degree=entry.degree, chunk_lens=tuple(entry_chunks)))
    ids, pos, tgt, seq = (np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in columns)
    ids_T, pos_T, tgt_T, seq_T = (torch.from_numpy(c) for c in (ids, pos, tgt, seq))
    layout = DacpLayout(cp_size=cp_size, local_lens=tuple(local_lens), dist_chunk_lens=tuple(chunk_lens),
                        partial=tuple(partial))
    label_rows = torch.from_numpy(np.flatnonzero(tgt != IGNORE_INDEX).astype(np.int64))
    return RankBatch(input_ids=ids_T, position_ids=pos_T, targets=tgt_T, seq_index=seq_T, layout=layout,
                     label_rows=label_rows, num_label_tokens=int(label_rows.shape[0]))


def _chunk_batch(local: tuple[int, ...], span: ChunkLike, input_ids: Sequence, labels: Sequence,
                 cp_size: int) -> RankBatch:
    """The stream of one dependent chunk: tokens [start, stop) of the rank's one local sequence."""
    (index,) = local
    ids, lab = _sequence(input_ids, labels, index)
    if span.stop > ids.size:
        raise ValueError(f"chunk [{span.start}, {span.stop}) of sequence {index} is beyond its "
                         f"{ids.size} tokens")
    rows = slice(span.start, span.stop)
    tgt = shifted_targets(lab)[rows]
    label_rows = torch.from_numpy(np.flatnonzero(tgt != IGNORE_INDEX).astype(np.int64))
    return RankBatch(input_ids=torch.from_numpy(ids[rows].copy()),
                     position_ids=torch.arange(span.start, span.stop, dtype=torch.int64),
                     targets=torch.from_numpy(tgt.copy()),
                     seq_index=torch.full((span.stop - span.start,), index, dtype=torch.int64),
                     layout=DacpLayout(cp_size=cp_size, local_lens=(span.stop - span.start,)),
                     label_rows=label_rows, num_label_tokens=int(label_rows.shape[0]), chunk=span)
