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

Plans are frozen, slotted and keyword-only; they pickle, and `to_dict()` / `from_dict()` give plain JSON
(a two-level plan has no `partial` key, so its JSON is the same whether or not a reader knows them).
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
class DacpPlan:
    """One micro-batch of one CP group: per CP rank its local sequences, plus the distributed ones."""

    local: tuple[tuple[int, ...], ...]
    """local[r]: indices of sequences kept whole on CP rank r (len(local) == cp_size)."""
    distributed: tuple[int, ...] = ()
    """Indices of sequences sharded over all CP ranks (balanced causal shards)."""
    partial: tuple[SubgroupShards, ...] = ()
    """Sequences sharded over aligned subgroups of 1 < d < N ranks, one entry per (degree, group), in
    canonical order: degree descending, then group."""

    def __post_init__(self) -> None:
        local = tuple(_index_tuple(rank, "DacpPlan.local") for rank in self.local)
        distributed = _index_tuple(self.distributed, "DacpPlan.distributed")
        partial = tuple(self.partial)
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "distributed", distributed)
        object.__setattr__(self, "partial", partial)
        if not local:
            raise ValueError("DacpPlan.local needs one tuple per CP rank (cp_size >= 1)")
        self._check_partial(len(local))
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

    @property
    def cp_size(self) -> int:
        return len(self.local)

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
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DacpPlan:
        partial = tuple(SubgroupShards(degree=int(e["degree"]), group=int(e["group"]),
                                       indices=tuple(e["indices"])) for e in data.get("partial", ()))
        return cls(local=tuple(tuple(r) for r in data["local"]), distributed=tuple(data["distributed"]),
                   partial=partial)

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
        return tuple(i for rank in self.micro_batches for mb in rank for i in mb.indices)

    def check(self, lengths: Sequence[int], bucket_size: int) -> None:
        """Raise SchedulingError unless every index of `lengths` appears once and every rank fits C."""
        if sorted(self.indices) != list(range(len(lengths))):
            raise SchedulingError("plan does not schedule every sequence of the global batch exactly once")
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
