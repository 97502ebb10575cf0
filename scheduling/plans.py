"""Plan dataclasses: what the scheduler hands to the workers, over *logical* ranks.

A step plan for DP=2 x CP=3 with two micro-batches per DP rank (indices refer to the global batch):

    StepPlan.micro_batches
    ├── dp 0: ( DacpPlan(local=((4,), (0, 7), (2,)), distributed=(9,)),      micro-batch 0
    │           DacpPlan(local=((1,), (3,), ()),      distributed=()) )      micro-batch 1
    └── dp 1: ( DacpPlan(local=((5, 6), (), (8,)),   distributed=()),        micro-batch 0
                DacpPlan(local=((), (), ()),          distributed=(10,)) )   micro-batch 1

CP rank r of a DacpPlan holds its `local[r]` sequences whole, then a 1/N shard of every sequence in
`distributed`, then (per-sequence CP degrees, docs/design.md §13) a 1/d shard of every sequence of each
`partial` entry whose aligned subgroup holds r: a `SubgroupShards(degree=d, group=g, ...)` is sharded over
CP ranks [g*d, (g+1)*d) only. Local is degree 1 and `distributed` degree N; `partial` holds the degrees in
between and is empty in every two-level (paper DACP) plan.

Memory is counted the way the workers lay tokens out: a local sequence costs S tokens on its rank, a
distributed one ceil(S / N) tokens on every rank, a degree-d one ceil(S / d) on each rank of its subgroup.
A DacpPlan may be empty (no sequences at all): the policies use that only to give every DP rank the same
number of micro-batches (ZeRO-2 needs equal backward counts per step), and the worker runs it as a
zero-loss micro-batch.

Dependent chunks (the chunkflow policy, scheduling/chunkflow.py): a micro-batch may carry `chunks`, one
entry per CP rank, each None or a `ChunkSpan`; a rank with a span holds exactly one local sequence and
trains only tokens [start, stop) of it, attending to the keys of its earlier chunks as well. The chunks of
one sequence sit on one (DP, CP) rank in consecutive micro-batches, chunk 0 first:

    dp 0: ( DacpPlan(local=((7,),), chunks=(ChunkSpan(chunk=0, num_chunks=3, start=0, stop=512),)),
            DacpPlan(local=((7,),), chunks=(ChunkSpan(chunk=1, num_chunks=3, start=512, stop=1024),)),
            DacpPlan(local=((7,),), chunks=(ChunkSpan(chunk=2, num_chunks=3, start=1024, stop=1300),)),
            DacpPlan(local=((1, 4),)) )                                          a standalone packed chunk

A chunked sequence therefore appears in several micro-batches; StepPlan.indices lists it once (at its
chunk 0). Micro-batches with chunks hold no sharded sequence (chunkflow has no ring).

Plans are frozen, slotted and keyword-only; they pickle, and `to_dict()` / `from_dict()` give plain JSON
(a two-level plan has no `partial` key and a plan without chunks no `chunks` key, so its JSON is the same
whether or not a reader knows them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class SchedulingError(ValueError):
    """No valid plan exists for the given input; the message names the config knob to change."""


def shard_tokens(length: int, cp_size: int) -> int:
    """Tokens one CP rank holds of a sequence sharded over `cp_size` ranks: ceil(S / N).

    This is the paper's accounting and the one BucketSize is checked against. The workers' zigzag split
    pads a distributed sequence to a multiple of 2N (2 * ceil(S / 2N) tokens per rank), i.e. at most one
    label-free pad token per distributed sequence beyond this count: negligible next to C, so the plan
    keeps the paper's bound (a sequence of exactly C*N tokens stays schedulable).
    """
    return -(-length // cp_size)


def _index_tuple(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"{what}: indices must be >= 0, got {out}")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SubgroupShards:
    """Sequences sharded over one aligned subgroup of the CP group: CP ranks [group*degree, (group+1)*degree).

    1 < degree < cp_size and degree divides cp_size (DacpPlan checks both against its cp_size); the
    subgroup's ranks each hold a ceil(S / degree) zigzag shard of every sequence in `indices`.
    """

    degree: int
    group: int
    indices: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", _index_tuple(self.indices, "SubgroupShards.indices"))
        if self.degree < 2 or self.group < 0:
            raise ValueError(f"SubgroupShards: degree must be >= 2 and group >= 0, got degree {self.degree}, "
                             f"group {self.group}")
        if not self.indices:
            raise ValueError("SubgroupShards: an entry needs at least one sequence")

    @property
    def ranks(self) -> range:
        """The CP ranks of the subgroup."""
        return range(self.group * self.degree, (self.group + 1) * self.degree)

    def to_dict(self) -> dict[str, Any]:
        return {"degree": self.degree, "group": self.group, "indices": list(self.indices)}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkSpan:
    """Chunk `chunk` of `num_chunks` of one sequence: its tokens [start, stop), attending to [0, stop).

    `recompute`: the chunk's activations are not kept after its first forward (which only fills the
    earlier-chunk key/value store); it is forwarded again just before its backward (docs/design.md §15).
    """

    chunk: int
    num_chunks: int
    start: int
    stop: int
    recompute: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.chunk < self.num_chunks or not 0 <= self.start < self.stop:
            raise ValueError(f"ChunkSpan: need 0 <= chunk < num_chunks and 0 <= start < stop, got {self}")
        if self.chunk == 0 and self.start != 0:
            raise ValueError(f"ChunkSpan: chunk 0 starts at token 0, got start {self.start}")

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    @property
    def last(self) -> bool:
        return self.chunk == self.num_chunks - 1

    def to_dict(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "num_chunks": self.num_chunks, "start": self.start, "stop": self.stop,
                "recompute": self.recompute}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkSpan:
        return cls(chunk=int(data["chunk"]), num_chunks=int(data["num_chunks"]), start=int(data["start"]),
                   stop=int(data["stop"]), recompute=bool(data.get("recompute", False)))


@dataclass(frozen=True, slots=True, kw_only=True)
class DacpPlan:
    """One micro-batch of one CP group: per CP rank its local sequences, plus the distributed ones."""

    local: tuple[tuple[int, ...], ...]
    """local[r]: indices of sequences kept whole on CP rank r (len(local) == cp_size)."""
    distributed: tuple[int, ...] = ()
    """Indices of sequences sharded over all CP ranks (balanced causal shards)."""
    partial: tuple[SubgroupShards, ...] = ()
    """Sequences sharded over aligned subgroups of 1 < d < N ranks, one entry per (degree, group), in
    canonical order: degree descending, then group."""
    chunks: tuple[ChunkSpan | None, ...] = ()
    """Empty, or per CP rank None (its local sequences whole) or the span of its one local sequence that
    it trains in this micro-batch (a dependent chunk, module docstring)."""

    def __post_init__(self) -> None:
        local = tuple(_index_tuple(rank, "DacpPlan.local") for rank in self.local)
        distributed = _index_tuple(self.distributed, "DacpPlan.distributed")
        partial = tuple(self.partial)
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "distributed", distributed)
        object.__setattr__(self, "partial", partial)
        object.__setattr__(self, "chunks", tuple(self.chunks))
        if not local:
            raise ValueError("DacpPlan.local needs one tuple per CP rank (cp_size >= 1)")
        self._check_partial(len(local))
        self._check_chunks()
        flat = [i for rank in local for i in rank] + list(distributed)
        flat += [i for entry in partial for i in entry.indices]
        if len(flat) != len(set(flat)):
            raise ValueError(f"DacpPlan schedules an index twice: {sorted(flat)}")

    def _check_partial(self, cp_size: int) -> None:
        keys = [(-e.degree, e.group) for e in self.partial]
        if keys != sorted(set(keys)):
            raise ValueError("DacpPlan.partial: one entry per (degree, group), degree descending then group")
        for entry in self.partial:
            if entry.degree >= cp_size or cp_size % entry.degree or entry.group >= cp_size // entry.degree:
                raise ValueError(f"DacpPlan.partial: degree {entry.degree} group {entry.group} is not an "
                                 f"aligned subgroup of a {cp_size}-rank CP group")

    def _check_chunks(self) -> None:
        if not self.chunks:
            return
        if len(self.chunks) != len(self.local):
            raise ValueError(f"DacpPlan.chunks: one entry per CP rank ({len(self.local)}), "
                             f"got {len(self.chunks)}")
        if self.distributed or self.partial:
            raise ValueError("DacpPlan.chunks: a micro-batch with dependent chunks shards no sequence")
        for rank, span in zip(self.local, self.chunks, strict=True):
            if span is not None and len(rank) != 1:
                raise ValueError(f"DacpPlan.chunks: a CP rank with a chunk holds exactly one sequence, "
                                 f"got {rank}")

    @property
    def cp_size(self) -> int:
        return len(self.local)

    def chunk_on(self, cp_rank: int) -> ChunkSpan | None:
        """The dependent chunk CP rank `cp_rank` trains in this micro-batch (None: whole sequences)."""
        return self.chunks[cp_rank] if self.chunks else None

    @property
    def indices(self) -> tuple[int, ...]:
        """Every index of the micro-batch: local ones rank by rank, the distributed ones, then the partial."""
        partial = tuple(i for entry in self.partial for i in entry.indices)
        return tuple(i for rank in self.local for i in rank) + self.distributed + partial

    def partial_on(self, cp_rank: int) -> tuple[SubgroupShards, ...]:
        """The partial entries whose subgroup holds `cp_rank` (at most one per degree), in plan order."""
        return tuple(entry for entry in self.partial if cp_rank in entry.ranks)

    def degree_of(self, index: int) -> int:
        """The CP degree of one scheduled sequence: 1 local, cp_size distributed, else its entry's degree."""
        if index in self.distributed:
            return self.cp_size
        for entry in self.partial:
            if index in entry.indices:
                return entry.degree
        if any(index in rank for rank in self.local):
            return 1
        raise KeyError(f"sequence {index} is not in this micro-batch")

    def rank_tokens(self, lengths: Sequence[int]) -> tuple[int, ...]:
        """Tokens each CP rank holds: its local sequences, ceil(S/N) of every distributed one and
        ceil(S/d) of every sequence of the partial entries whose subgroup holds it."""
        shards = sum(shard_tokens(int(lengths[i]), self.cp_size) for i in self.distributed)
        tokens = [sum(int(lengths[i]) for i in rank) + shards for rank in self.local]
        for r, span in enumerate(self.chunks):
            if span is not None:
                tokens[r] = span.num_tokens
        for entry in self.partial:
            part = sum(shard_tokens(int(lengths[i]), entry.degree) for i in entry.indices)
            for r in entry.ranks:
                tokens[r] += part
        return tuple(tokens)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"local": [list(rank) for rank in self.local],
                               "distributed": list(self.distributed)}
        if self.partial:  # absent in two-level plans: their JSON is the two-level form
            out["partial"] = [entry.to_dict() for entry in self.partial]
        if self.chunks:  # absent unless chunkflow: every other plan's JSON is unchanged
            out["chunks"] = [None if span is None else span.to_dict() for span in self.chunks]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DacpPlan:
        partial = tuple(SubgroupShards(degree=int(e["degree"]), group=int(e["group"]),
                                       indices=tuple(e["indices"])) for e in data.get("partial", ()))
        chunks = tuple(None if c is None else ChunkSpan.from_dict(c) for c in data.get("chunks", ()))
        return cls(local=tuple(tuple(r) for r in data["local"]), distributed=tuple(data["distributed"]),
                   partial=partial, chunks=chunks)

    @classmethod
    def empty(cls, cp_size: int) -> DacpPlan:
        return cls(local=((),) * cp_size, distributed=())


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """One global batch: per DP rank, an equal-length tuple of micro-batches (DacpPlans)."""

    micro_batches: tuple[tuple[DacpPlan, ...], ...]

    def __post_init__(self) -> None:
        batches = tuple(tuple(rank) for rank in self.micro_batches)
        object.__setattr__(self, "micro_batches", batches)
        if not batches or not batches[0]:
            raise ValueError("StepPlan needs >= 1 DP rank with >= 1 micro-batch")
        if len({len(rank) for rank in batches}) != 1:
            counts = [len(rank) for rank in batches]
            raise ValueError(f"StepPlan: DP ranks must have equal micro-batch counts (ZeRO-2), got {counts}")
        if len({mb.cp_size for rank in batches for mb in rank}) != 1:
            raise ValueError("StepPlan: every micro-batch must have the same cp_size")
        flat = self.indices
        if len(flat) != len(set(flat)):
            raise ValueError("StepPlan schedules an index twice")
        if self.has_chunks:
            _check_chunk_runs(batches)

    @property
    def has_chunks(self) -> bool:
        """Some micro-batch trains a dependent chunk (the chunkflow policy)."""
        return any(mb.chunks for rank in self.micro_batches for mb in rank)

    @property
    def dp_size(self) -> int:
        return len(self.micro_batches)

    @property
    def cp_size(self) -> int:
        return self.micro_batches[0][0].cp_size

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0])

    @property
    def indices(self) -> tuple[int, ...]:
        """Every scheduled sequence once, in plan order (a chunked sequence at its chunk 0)."""
        if not self.has_chunks:
            return tuple(i for rank in self.micro_batches for mb in rank for i in mb.indices)
        return tuple(i for rank in self.micro_batches for mb in rank for r, seqs in enumerate(mb.local)
                     for i in seqs if (span := mb.chunk_on(r)) is None or span.chunk == 0)

    def check(self, lengths: Sequence[int], bucket_size: int) -> None:
        """Raise SchedulingError unless every index of `lengths` appears once, every rank fits C and every
        chunked sequence's chunks cover it."""
        if sorted(self.indices) != list(range(len(lengths))):
            raise SchedulingError("plan does not schedule every sequence of the global batch exactly once")
        for rank in self.micro_batches:
            for mb in rank:
                for seqs, span in zip(mb.local, mb.chunks, strict=False):
                    if span is not None and span.last and span.stop != int(lengths[seqs[0]]):
                        raise SchedulingError(f"the chunks of sequence {seqs[0]} end at token {span.stop}, "
                                              f"not at its length {int(lengths[seqs[0]])}")
        for dp, rank in enumerate(self.micro_batches):
            for m, mb in enumerate(rank):
                worst = max(mb.rank_tokens(lengths))
                if worst > bucket_size:
                    raise SchedulingError(
                        f"dp rank {dp} micro-batch {m} holds {worst} tokens on one CP rank > "
                        f"scheduling.bucket_size={bucket_size}"
                    )

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batches": [[mb.to_dict() for mb in rank] for rank in self.micro_batches]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepPlan:
        return cls(micro_batches=tuple(
            tuple(DacpPlan.from_dict(mb) for mb in rank) for rank in data["micro_batches"]
        ))


def _check_chunk_runs(batches: tuple[tuple[DacpPlan, ...], ...]) -> None:
    """ValueError unless, on every (DP, CP) rank, each chunked sequence's chunks 0..n-1 come in consecutive
    micro-batches with contiguous token ranges (what the workers' schedule runs: workers/chunkflow.py)."""
    for dp, rank in enumerate(batches):
        for r in range(rank[0].cp_size):
            open_span: tuple[int, ChunkSpan] | None = None
            for m, mb in enumerate(rank):
                span = mb.chunk_on(r)
                if open_span is not None:
                    index, previous = open_span
                    if (span is None or mb.local[r][0] != index or span.chunk != previous.chunk + 1
                            or span.num_chunks != previous.num_chunks or span.start != previous.stop):
                        raise ValueError(f"StepPlan: dp {dp} cp {r} micro-batch {m}: chunk "
                                         f"{previous.chunk + 1} of sequence {index} must follow chunk "
                                         f"{previous.chunk} directly")
                elif span is not None and span.chunk != 0:
                    raise ValueError(f"StepPlan: dp {dp} cp {r} micro-batch {m}: chunk {span.chunk} of "
                                     f"sequence {mb.local[r][0]} without its chunk 0 before it")
                open_span = None if span is None or span.last else (mb.local[r][0], span)
            if open_span is not None:
                raise ValueError(f"StepPlan: dp {dp} cp {r}: sequence {open_span[0]} ends at chunk "
                                 f"{open_span[1].chunk} of {open_span[1].num_chunks}")
