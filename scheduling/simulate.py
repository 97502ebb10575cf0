"""Modeled iteration time of any StepPlan under a CostModel (+ its HardwareProfile).

For CP rank j of one micro-batch (the DACP overlap formula, docs/design.md §3):

    Time_j = max(T_comm(V), T_comp(Local_j)) + T_comp(Dist) + b
             (max: the ring fully hidden; with the profile's ring_overlap o < 1 the first term is
              T_comm + T_comp(Local_j) - o * min(T_comm, T_comp(Local_j)), which is >= the max, so the
              lower bounds below stay lower bounds)

    (+ k * sharded_sequence_s(N) for k distributed sequences: what each sharded sequence costs every
     rank beyond its FLOPs and bytes, the profile's ring_sequence_step_s, 0 unless fitted; a degree-d
     sequence costs the d ranks of its subgroup sharded_sequence_s(d). It only adds to sharded plans, so
     the bounds below stay lower bounds, and their sharded options include it.)

    micro-batch time = max_j Time_j            (CP ranks synchronize in the ring / the backward)
    DP rank time     = sum over its micro-batches
    step time        = max over DP ranks       (gradient reduction waits for the slowest)

Two lower bounds (b = b(D*N), the per-micro-batch cost of cost.micro_batch_overhead_s):

    bound          = T_comp(sum_k F_k / (D*N)) + b                       the perfect-balance bound
    feasible_bound = max(bound, min(T_comp(F*) + b,                       * = the longest sequence
                                    T_comm(V*, N) + T_comp(F*/N) + b))

Proof that both are lower bounds of every plan's step time under this cost model (T_comp is linear and
T_comm is non-decreasing in the volume; all terms are >= 0):
- perfect balance: a DP rank d with m_d >= 1 micro-batches takes sum_mu max_j Time_j >= sum_mu (mean_j
  T_comp(Local_j) + T_comp(Dist_mu) + b) >= T_comp(F_d / N) + b, F_d being the FLOPs d holds (each local
  sequence counts once, each distributed one N times F/N). step = max_d >= mean_d >= T_comp(F / (D*N)) + b.
- longest sequence: it sits in one micro-batch mu of one DP rank, so step >= Time of mu. Kept local on
  rank j: Time_j >= T_comp(Local_j) + b >= T_comp(F*) + b. Distributed: V_mu >= V*, Dist_mu >= F*/N, so
  Time_j >= T_comm(V*, N) + T_comp(F*/N) + b. Either way step >= the min of the two. F and V grow with S,
  so the longest sequence gives the largest such bound.
Per-sequence CP degrees (docs/design.md §13): a micro-batch may also hold partial entries, sequences
sharded over an aligned subgroup of d ranks (1 < d < N). Rank j then runs the ring of every subgroup that
holds it (the whole group's, and one per entry on j), summed (they share j's links), and its sharded work:

    Time_j = overlapped(sum of j's rings, T_comp(Local_j)) + T_comp(Sharded_j) + b,
             Sharded_j = sum_dist F/N + sum over j's entries of F/d

(mixed_placement_times; with no partial entry it is the formula above, computed by the same code). Both
bounds stay lower bounds, with the longest sequence's term taken over every allowed degree:

    feasible_bound = max(bound, min_d [T_comp(F*) if d = 1, ring_floor(V*, d) + T_comp(F*/d) otherwise] + b)

- perfect balance: overlapped(c, l) >= l, so Time_j >= T_comp(Local_j) + T_comp(Sharded_j) + b; a
  degree-d sequence puts F/d on each of d ranks, so sum_j (Local_j + Sharded_j) is still the micro-batch's
  FLOPs and the mean over j gives the same inequality as in the two-level case.
- longest sequence at degree d > 1 on rank j of its subgroup: overlapped(c, l) >= c >= its own ring (the
  sum holds it, rings are >= 0 and non-decreasing in the volume, V_entry >= V*), and Sharded_j >= F*/d,
  so Time_j >= ring(V*, d) + T_comp(F*/d) + b >= ring_floor(V*, d) + T_comp(F*/d) + b, ring_floor being
  the cheaper of the intra- and inter-node rings of d ranks (scheduling.cost.ring_lower_bound; degree N
  keeps t_comm(V*, N) exactly, so [1, N] gives the bound above unchanged). Local (d = 1): as in the
  two-level case. The step is at least the min over the allowed degrees.
`simulate` allows 1, N, every degree the plan uses and `cp_degrees` (plan_report passes the config's, so
every policy of one report gets the same bound).

Dependent chunks (the chunkflow policy, DacpPlan.chunks): nothing is sharded, so rank j of such a
micro-batch takes T_comp(F_j) + b, F_j its standalone chunk's FLOPs or its dependent chunk's
(CostModel.chunk_flop_terms: a later chunk's queries also attend to every earlier chunk's keys), plus one
extra forward of the chunk's decoder FLOPs (CostModel.t_forward) when the chunk is recomputed. Both bounds
stay lower bounds: a chunked sequence's chunks sum to its own FLOPs and each pays b, so its rank spends at
least T_comp(F) + b on it, the "kept local" case of the proof.

bound_ratio = step / bound (what the issue asks for; >= 1) also counts what no plan can avoid when one
sequence outweighs a DP group's fair share; bound_ratio_feasible = step / feasible_bound does not.

Imbalances are max/mean: dp_imbalance over the DP ranks' times; cp_imbalance = sum over micro-batches of
max_j Time_j over sum of mean_j Time_j, i.e. the time CP groups spend waiting for their slowest rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduling.cost import Clock, CostModel, SubgroupClock, ring_lower_bound
from scheduling.plans import DacpPlan, StepPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEstimate:
    """Modeled times (seconds) of one StepPlan."""

    step_s: float
    bound_s: float
    feasible_bound_s: float
    """max(bound_s, the longest sequence's best time alone): see the module docstring."""
    dp_rank_s: tuple[float, ...]
    """Per DP rank: sum over its micro-batches of the micro-batch time."""
    rank_busy_s: tuple[tuple[float, ...], ...]
    """Per DP rank, per CP rank: sum over micro-batches of Time_j (what a per-rank plot shows)."""
    cp_imbalance: float
    distributed_token_fraction: float
    num_micro_batches: int
    optimizer_s: float = 0.0
    """The once-per-step optimizer time (CostModel.optimizer_step_s), the same for every plan of a batch:
    part of `total_s`, not of step_s (which the policies compare)."""

    @property
    def total_s(self) -> float:
        """The modeled wall time of the whole step: the plan's micro-batches and the optimizer step."""
        return self.step_s + self.optimizer_s

    @property
    def bound_ratio(self) -> float:
        return self.step_s / self.bound_s

    @property
    def bound_ratio_feasible(self) -> float:
        return self.step_s / self.feasible_bound_s

    @property
    def dp_imbalance(self) -> float:
        return max(self.dp_rank_s) / (sum(self.dp_rank_s) / len(self.dp_rank_s))


def rank_times(plan: DacpPlan, lengths: Sequence[int], flops: Sequence[float],
               cost: CostModel, *, world: int = 1, cp_group: int = 0) -> list[float]:
    """Time_j of every CP rank j of one micro-batch; `world` = DP x CP ranks (sizes b), `cp_group` the DP
    rank whose CP group runs it (which node boundaries its subgroups cross)."""
    sharded = list(plan.distributed) + [i for e in plan.partial for i in e.indices]
    kv = {i: cost.kv_bytes(float(lengths[i])) for i in sharded}
    return plan_times(plan, flops, kv, SubgroupClock(cost, plan.cp_size, world, cp_group))


def placement_times(local: Sequence[Sequence[int]], distributed: Sequence[int], flops: Sequence[float],
                    kv: Any, clock: Clock) -> list[float]:
    """rank_times of the placement (local per CP rank, distributed) from per-sequence FLOPs and K/V bytes
    (`kv[i]` = cost.kv_bytes(S_i)) and the micro-batch's cost Clock: the planners' inner loop, which
    keeps those per batch instead of building a DacpPlan per trial."""
    comp, overlapped = clock.comp, clock.overlapped
    dist_flops = sum(map(flops.__getitem__, distributed)) / clock.cp_size
    comm = clock.comm(sum(map(kv.__getitem__, distributed)))
    tail = comp(dist_flops) + clock.overhead + len(distributed) * clock.seq_s
    if not any(local):  # all sharded (or empty): every rank the same, sum(()) = 0 local FLOPs
        return [overlapped(comm, comp(0)) + tail] * len(local)
    flops_of = flops.__getitem__
    return [overlapped(comm, comp(sum(map(flops_of, rank)))) + tail for rank in local]


Partial = Sequence[tuple[int, int, Sequence[int]]]
"""A micro-batch's partial entries as (degree, group, indices) triples (DacpPlan.partial, unwrapped)."""


def mixed_placement_times(local: Sequence[Sequence[int]], distributed: Sequence[int], partial: Partial,
                          flops: Sequence[float], kv: Any, clock: SubgroupClock) -> list[float]:
    """Time_j of every CP rank of a micro-batch with per-sequence CP degrees (module docstring, design §13).

    Rank j runs the rings of every subgroup holding it (the whole group's for `distributed`, one per
    partial entry on j) on its own links, so its ring time is their sum; the rings of subgroups that do
    not hold j cost j nothing (they run concurrently with j's work). With an empty `partial` this is
    placement_times, bit for bit (it is called instead)."""
    base = clock.base
    if not partial:
        return placement_times(local, distributed, flops, kv, base)
    n = clock.cp_size
    comm = [base.comm(sum(map(kv.__getitem__, distributed)))] * n
    shard = [sum(map(flops.__getitem__, distributed)) / n] * n
    extra = [len(distributed) * base.seq_s] * n  # per sharded sequence (sharded_sequence_s)
    for degree, group, indices in partial:
        ring = clock.ring(degree, group, sum(map(kv.__getitem__, indices)))
        work = sum(map(flops.__getitem__, indices)) / degree
        for r in range(group * degree, (group + 1) * degree):
            comm[r] += ring
            shard[r] += work
            extra[r] += len(indices) * clock.seq_s[degree]
    comp, overlapped, overhead = base.comp, base.overlapped, base.overhead
    flops_of = flops.__getitem__
    return [overlapped(comm[j], comp(sum(map(flops_of, local[j])))) + (comp(shard[j]) + overhead + extra[j])
            for j in range(n)]


def plan_times(plan: DacpPlan, flops: Sequence[float], kv: Any, clock: SubgroupClock) -> list[float]:
    """Time_j of every CP rank of one DacpPlan (two-level or with partial entries)."""
    if not plan.partial:
        return placement_times(plan.local, plan.distributed, flops, kv, clock.base)
    partial = [(e.degree, e.group, e.indices) for e in plan.partial]
    return mixed_placement_times(plan.local, plan.distributed, partial, flops, kv, clock)


def chunk_rank_times(plan: DacpPlan, lengths: Sequence[int], labels: Sequence[int] | None,
                     flops: Sequence[float], cost: CostModel, clock: Clock) -> list[float]:
    """Time_j of every CP rank of a micro-batch with dependent chunks (module docstring): T_comp of its
    standalone or dependent chunk, + one decoder forward if the chunk is recomputed, + b."""
    times = []
    for seqs, span in zip(plan.local, plan.chunks, strict=True):
        if span is None:
            times.append(clock.comp(sum(flops[i] for i in seqs)) + clock.overhead)
            continue
        (index,) = seqs
        terms = cost.chunk_flop_terms(int(lengths[index]), span.start, span.stop,
                                      None if labels is None else labels[index])
        extra = cost.t_forward(terms["linear"] + terms["attention"]) if span.recompute else 0.0
        times.append(clock.comp(sum(terms.values())) + clock.overhead + extra)
    return times


def micro_batch_time(local: Sequence[Sequence[int]], distributed: Sequence[int], flops: Sequence[float],
                     kv: Any, clock: Clock) -> float:
    """Modeled seconds of one micro-batch: max_j Time_j (placement_times)."""
    return max(placement_times(local, distributed, flops, kv, clock))


def heaviest_sequence(flops: Sequence[float], lengths: Sequence[int]) -> int:
    """The index with the most FLOPs, ties to the longest, then to the lowest index (non-empty batch)."""
    weights = np.asarray(flops, dtype=np.float64)
    ties = np.flatnonzero(weights == weights.max())
    if len(ties) == 1:
        return int(ties[0])
    return int(ties[np.argmax(np.asarray(lengths, dtype=np.int64)[ties])])  # argmax: the first of equals


def perfect_balance_bound(flops: Sequence[float], cost: CostModel, world: int) -> float:
    """T_comp(sum_k F_k / W) + b(W): every plan's step is at least this (module docstring)."""
    return cost.t_comp(sum(flops) / world) + cost.micro_batch_overhead_s(world)


def alone_floor(cost: CostModel, flops: float, volume: float, cp_size: int,
                cp_degrees: Sequence[int] | None = None) -> float:
    """The fastest one sequence (F FLOPs, V K/V bytes) can run in any micro-batch, without b:
    min over its possible degrees d of T_comp(F) (d = 1) or ring_floor(V, d) + T_comp(F/d) (module
    docstring). `cp_degrees` None is (1, N): exactly the two-level bound."""
    alone = min(cost.t_comp(flops), cost.t_comm(volume, cp_size) + cost.t_comp(flops / cp_size)
                + cost.sharded_sequence_s(cp_size))
    for degree in cp_degrees or ():
        if 1 < degree < cp_size:
            alone = min(alone, ring_lower_bound(cost, volume, degree, cp_size) + cost.t_comp(flops / degree)
                        + cost.sharded_sequence_s(degree))
    return alone


def lower_bounds(lengths: Sequence[int], cost: CostModel, *, dp_size: int, cp_size: int,
                 labels: Sequence[int] | None = None,
                 cp_degrees: Sequence[int] | None = None) -> tuple[float, float]:
    """(perfect-balance bound, feasible bound) of any plan of `lengths` (see the module docstring).

    The "longest" sequence of the proof is the one with the most FLOPs (with label counts, a slightly
    shorter sequence can outweigh the longest one; every step of the proof holds for it as well).
    `cp_degrees`: the CP degrees plans may use (None: 1 and N, the two-level bound, unchanged).
    """
    world = dp_size * cp_size
    overhead = cost.micro_batch_overhead_s(world)
    all_flops = cost.sequence_flops(lengths, labels)
    bound = perfect_balance_bound(all_flops, cost, world)
    if not len(lengths):
        return bound, bound
    heaviest = heaviest_sequence(all_flops, lengths)
    flops = all_flops[heaviest]
    alone = alone_floor(cost, flops, cost.kv_bytes(float(lengths[heaviest])), cp_size, cp_degrees) + overhead
    return bound, max(bound, alone)


def simulate(step: StepPlan, lengths: Sequence[int], cost: CostModel,
             labels: Sequence[int] | None = None, cp_degrees: Sequence[int] | None = None) -> StepEstimate:
    """Model one step; `lengths` (and `labels`, label tokens per sequence) is the global batch the plan's
    indices refer to. `cp_degrees`: the degrees the feasible bound allows (None: 1, N and every degree
    the plan uses, so the bound holds for this plan)."""
    flops = cost.sequence_flops(lengths, labels)
    world = step.dp_size * step.cp_size
    clock = cost.clock(step.cp_size, world)
    kv = cost.kv_bytes(np.asarray(lengths, dtype=np.float64)).tolist()  # elementwise: kv_bytes(float(S))
    used = {e.degree for rank in step.micro_batches for mb in rank for e in mb.partial}
    dp_times, busy = [], []
    worst_total = mean_total = 0.0
    for dp, rank in enumerate(step.micro_batches):
        per_cp = [0.0] * step.cp_size
        total = 0.0
        sclock = SubgroupClock(cost, step.cp_size, world, dp) if used else None
        for mb in rank:
            if mb.chunks:
                times = chunk_rank_times(mb, lengths, labels, flops, cost, clock)
            else:
                times = (plan_times(mb, flops, kv, sclock) if sclock is not None and mb.partial
                         else placement_times(mb.local, mb.distributed, flops, kv, clock))
            total += max(times)
            worst_total += max(times)
            mean_total += sum(times) / len(times)
            per_cp = [a + b for a, b in zip(per_cp, times, strict=True)]
        dp_times.append(total)
        busy.append(tuple(per_cp))
    degrees = sorted(used) if cp_degrees is None else sorted(set(cp_degrees) | used)
    bound, feasible = lower_bounds(lengths, cost, dp_size=step.dp_size, cp_size=step.cp_size, labels=labels,
                                   cp_degrees=degrees)
    tokens = sum(int(s) for s in lengths)
    distributed = sum(int(lengths[i]) for r in step.micro_batches for mb in r
                      for i in (*mb.distributed, *(j for e in mb.partial for j in e.indices)))
    return StepEstimate(
        step_s=max(dp_times), bound_s=bound, feasible_bound_s=feasible, dp_rank_s=tuple(dp_times),
        rank_busy_s=tuple(busy),
        cp_imbalance=worst_total / mean_total, distributed_token_fraction=distributed / max(tokens, 1),
        num_micro_batches=step.num_micro_batches, optimizer_s=cost.optimizer_step_s(world),
    )
