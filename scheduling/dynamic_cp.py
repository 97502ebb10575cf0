"""dynamic_cp: a Megatron-style baseline of per-sequence CP degrees (docs/design.md §13).

Megatron-Core's dynamic context parallelism gives every sample its own power-of-two CP size and balances
micro-batches by a quadratic work estimate. This policy plans with those rules on our plans and runtime:

    1. degree   each sequence at the smallest degree d of `cp_degrees` (default: every power of two up to
                N) whose shard fits: ceil(S/d) <= C (so short sequences stay whole, d = 1)
    2. work     quadratic only: S^2 / d on each of its d ranks (S^2 per sequence), nothing linear, no
                communication term
    3. DP split greedy LPT by S^2: heaviest first, each to the DP rank with the least work so far
    4. buckets  per DP rank, m micro-batches starting at ceil(sum_i d_i*ceil(S_i/d_i) / (C*N)); sequences
                heaviest first, each into the micro-batch with the least work among those where some
                aligned subgroup of its degree has room for ceil(S/d) tokens on every rank, on the
                subgroup whose busiest rank has the least work (ties: lowest group); m += 1 until all fit
                (m = one sequence per micro-batch always fits)
    5. counts   every DP rank re-bucketed to the largest count (equal-work buckets over more micro-batches;
                padded with empty micro-batches if that re-bucketing does not fit), as ZeRO-2 needs

What it models of Megatron's dynamic CP: per-sample power-of-two CP sizes chosen by memory (the smallest
group whose shard fits), the S^2-only work estimate and equal-work micro-batches with equal counts per DP
rank. What it does not: Megatron's own packing solver and its sub-sequence splitting details, its
process-group layout and kernels (plans run on this project's runtime: one ring per aligned subgroup,
concurrent with the local sequences' attention, which Megatron does not overlap), and any cost-model
choice: unlike skrull's DACP it never trades a ring for local work, never looks at FLOPs of the linear
layers or at link bandwidth, and does not know where node boundaries are. `simulate` times its plans with
the same cost model as every policy, so the comparison isolates the scheduling rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduling.balanced_packed import lpt_partition
from scheduling.dacp import check_fits
from scheduling.dacp_degrees import resolve_cp_degrees
from scheduling.plans import DacpPlan, StepPlan, SubgroupShards

__all__ = ["DynamicCpLayout", "dynamic_cp", "dynamic_cp_layout", "smallest_degrees"]


def smallest_degrees(lengths: Sequence[int], cp_size: int, bucket_size: int,
                     degrees: Sequence[int]) -> list[int]:
    """Per sequence, the smallest degree of `degrees` whose shard ceil(S/d) fits C (N when none does)."""
    tokens = np.asarray(lengths, dtype=np.int64)
    chosen = np.full(len(tokens), cp_size, dtype=np.int64)
    for d in sorted(degrees, reverse=True):  # the smallest fitting degree is written last
        chosen[-(-tokens // d) <= bucket_size] = d  # ceil(S/d) <= C: shard_tokens
    return chosen.tolist()


class _Bucket:
    """One micro-batch being filled: per CP rank its remaining tokens and its work, per sequence its slot."""

    __slots__ = ("remaining", "rank_work", "total", "slots")

    def __init__(self, cp_size: int, bucket_size: int) -> None:
        self.remaining = [bucket_size] * cp_size
        self.rank_work = [0.0] * cp_size
        self.total = 0.0
        self.slots: list[tuple[int, int, int]] = []  # (degree, group, index)

    def group_for(self, degree: int, shard: int) -> int | None:
        """The aligned group of `degree` with room whose busiest rank has the least work, or None."""
        if degree == 1:
            return self._rank_for(shard)
        best, best_work = None, 0.0
        for group in range(len(self.remaining) // degree):
            lo, hi = group * degree, (group + 1) * degree
            if min(self.remaining[lo:hi]) < shard:
                continue
            work = max(self.rank_work[lo:hi])
            if best is None or work < best_work:
                best, best_work = group, work
        return best

    def _rank_for(self, shard: int) -> int | None:
        """group_for at degree 1 without slices: most sequences are whole, and this runs per sequence."""
        best, best_work = None, 0.0
        for rank, room in enumerate(self.remaining):
            if room >= shard and (best is None or self.rank_work[rank] < best_work):
                best, best_work = rank, self.rank_work[rank]
        return best

    def add(self, index: int, degree: int, group: int, shard: int, work: float) -> None:
        for r in range(group * degree, (group + 1) * degree):
            self.remaining[r] -= shard
            self.rank_work[r] += work / degree
        self.total += work
        self.slots.append((degree, group, index))

    def plan(self, cp_size: int) -> DacpPlan:
        local: list[list[int]] = [[] for _ in range(cp_size)]
        entries: dict[tuple[int, int], list[int]] = {}
        for degree, group, index in self.slots:
            if degree == 1:
                local[group].append(index)
            else:
                entries.setdefault((degree, group), []).append(index)
        distributed = tuple(sorted(entries.pop((cp_size, 0), [])))
        partial = tuple(SubgroupShards(degree=d, group=g, indices=tuple(sorted(m)))
                        for (d, g), m in sorted(entries.items(), key=lambda e: (-e[0][0], e[0][1])))
        return DacpPlan(local=tuple(tuple(sorted(rank)) for rank in local), distributed=distributed,
                        partial=partial)


def _buckets(members: Sequence[int], count: int, *, work: Sequence[float], degree: Sequence[int],
             shard: Sequence[int], cp_size: int, bucket_size: int) -> list[_Bucket] | None:
    """Step 4 at a fixed count: heaviest first into the least-worked bucket that has room; None if one
    sequence finds no bucket."""
    buckets = [_Bucket(cp_size, bucket_size) for _ in range(count)]
    for i in sorted(members, key=lambda j: (-work[j], j)):
        for bucket in sorted(buckets, key=lambda b: b.total):  # stable: ties to the lower bucket
            group = bucket.group_for(degree[i], shard[i])
            if group is not None:
                bucket.add(i, degree[i], group, shard[i], work[i])
                break
        else:
            return None
    return buckets


@dataclass(frozen=True, slots=True)
class DynamicCpLayout:
    """What dynamic_cp decides from the lengths alone, before any bucketing (steps 1-3 and step 4's first
    micro-batch count): shared with skrull's lower bound of its step (scheduling.skrull.dynamic_cp_floor)."""

    degree: tuple[int, ...]
    """Per sequence, its CP degree d (step 1)."""
    shard: tuple[int, ...]
    """Per sequence, its tokens per rank ceil(S/d)."""
    work: tuple[float, ...]
    """Per sequence, S^2 (step 2)."""
    partition: tuple[tuple[int, ...], ...]
    """Per DP rank, its sequences (step 3)."""
    first_counts: tuple[int, ...]
    """Per DP rank, the micro-batch count step 4 starts from: ceil(sum d ceil(S/d) / (C N)), at least 1."""


def dynamic_cp_layout(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
                      cp_degrees: str | Sequence[int] | None = None) -> DynamicCpLayout:
    """Steps 1-3 of the module docstring and step 4's first count; the lengths must fit (check_fits)."""
    degrees = resolve_cp_degrees("auto" if cp_degrees is None else cp_degrees, cp_size)
    degree = smallest_degrees(lengths, cp_size, bucket_size, degrees)
    tokens = np.asarray(lengths, dtype=np.int64)
    shard = (-(-tokens // np.asarray(degree, dtype=np.int64))).tolist()  # shard_tokens per sequence
    work = (tokens.astype(np.float64) ** 2).tolist()
    partition = tuple(tuple(members) for members in lpt_partition(work, dp_size))
    capacity = bucket_size * cp_size
    counts = tuple(max(1, -(-sum(shard[i] * degree[i] for i in members) // capacity))
                   for members in partition)
    return DynamicCpLayout(degree=tuple(degree), shard=tuple(shard), work=tuple(work),
                           partition=partition, first_counts=counts)


def dynamic_cp(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
               cp_degrees: str | Sequence[int] | None = None) -> StepPlan:
    """Megatron-style dynamic CP (module docstring): smallest fitting power-of-two degree per sequence,
    S^2-balanced DP split and equal-work micro-batches, equal counts per DP rank."""
    check_fits(lengths, cp_size, bucket_size)
    layout = dynamic_cp_layout(lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                               cp_degrees=cp_degrees)
    shape = {"work": layout.work, "degree": layout.degree, "shard": layout.shard, "cp_size": cp_size,
             "bucket_size": bucket_size}
    per_rank: list[list[_Bucket]] = []
    for members, count in zip(layout.partition, layout.first_counts, strict=True):
        while (buckets := _buckets(members, count, **shape)) is None:
            count += 1  # ends: one sequence per bucket always fits (ceil(S/d) <= C)
        per_rank.append(buckets)
    target = max(len(b) for b in per_rank)
    plans = []
    for members, buckets in zip(layout.partition, per_rank, strict=True):
        if len(buckets) < target:
            buckets = _buckets(members, target, **shape) or buckets
        mbs = [b.plan(cp_size) for b in buckets]
        plans.append(tuple(mbs) + (DacpPlan.empty(cp_size),) * (target - len(mbs)))
    return StepPlan(micro_batches=tuple(plans))
