"""The `skrull` policy: GDS + DACP (+ refinement), and never a plan the cost model says a baseline beats.

    plan = plan_gds(DACP per micro-batch)
    if step(plan) <= the feasible lower bound of any plan:  return plan     (nothing can be faster)
    candidates = GDS-only (every sequence sharded, the GDS split), and with `baselines` (online
                 calibration, scheduling.calibration) balanced_packed and dynamic_cp too
    return the fastest under the cost model (ties keep the earlier: the DACP plan first)

Every candidate is a valid DACP output: an all-sharded micro-batch is one (GDS-only, balanced_packed), and
dynamic_cp's per-sequence degrees are local, whole-group or aligned-subgroup shards of the same cp_degrees
(with two-level cp_degrees it keeps each sequence local or shards it over the whole group). So Skrull may
always return any of them, and its modeled step is never above theirs: the guarantee holds exactly as far
as the cost model is right, which is why the planner refits it from the run's own steps (scheduling/
refit.py). The two all-sharded candidates are skipped when the DACP plan is at or below every all-sharded
plan's floor (`all_sharded_floor`), and dynamic_cp when it is at or below dynamic_cp's (`dynamic_cp_floor`);
the other ablations (DACP-only, round-robin) are not candidates: they run the same DACP machinery on worse
DP splits or placements and cost a full plan.

`explore=k` (online calibration's first steps, scheduling/actor.py) returns candidate k mod 4 of
(DACP plan, GDS-only, balanced_packed, dynamic_cp) instead of the fastest, so the measured steps cover
the plans Skrull chooses between. Without `baselines` and `explore` the plans are the paper's GDS + DACP
with only the GDS-only fallback (scheduling.calibration=off: fixed profile, the same plans every run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from scheduling.balanced_packed import balanced_packed
from scheduling.cost import CostModel
from scheduling.dynamic_cp import dynamic_cp, dynamic_cp_layout
from scheduling.gds import Execution, plan_gds_timed
from scheduling.plans import StepPlan
from scheduling.simulate import heaviest_sequence, lower_bounds, perfect_balance_bound, simulate

CANDIDATES = ("dacp", "gds_only", "balanced_packed", "dynamic_cp")
"""The plans skrull chooses between, in the order ties and exploration take them."""


def skrull(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
           cost: CostModel, labels: Sequence[int] | None = None,
           cp_degrees: str | Sequence[int] | None = None, baselines: bool = False,
           explore: int | None = None) -> StepPlan:
    """The fastest candidate plan under `cost` (module docstring); `explore`: candidate explore mod 4.

    `cp_degrees` (scheduling.cp_degrees; None: [1, N]) reaches DACP and dynamic_cp; the all-sharded
    candidates shard every sequence over the whole CP group."""
    shape = {"dp_size": dp_size, "cp_size": cp_size, "bucket_size": bucket_size}
    # plan_gds_timed's step time is simulate(plan).step_s, from the micro-batch times GDS compared
    plan, step_s = plan_gds_timed(lengths, cp_degrees=cp_degrees, cost=cost, labels=labels, **shape)
    assert step_s is not None  # refine=True: GDS modeled every micro-batch
    degrees = [1, cp_size] if cp_degrees is None else cp_degrees
    timed: dict[str, Callable[[], tuple[StepPlan, float]]] = {
        "gds_only": lambda: _timed(plan_gds_timed(lengths, execution=Execution.STATIC, cost=cost,
                                                  labels=labels, **shape)),
        "balanced_packed": lambda: _simulated(balanced_packed(lengths, cost=cost, labels=labels, **shape),
                                              lengths, cost, labels),
        "dynamic_cp": lambda: _simulated(dynamic_cp(lengths, cp_degrees=degrees, **shape), lengths, cost,
                                         labels),
    }
    if explore is not None:
        name = CANDIDATES[explore % len(CANDIDATES)]
        return plan if name == "dacp" else timed[name]()[0]
    if baselines and step_s <= lower_bounds(lengths, cost, dp_size=dp_size, cp_size=cp_size,
                                            labels=labels)[1]:
        return plan  # at the lower bound of every plan: no candidate can be faster
    sharded_floor = all_sharded_floor(lengths, cost, dp_size=dp_size, cp_size=cp_size, labels=labels)
    best, best_s = plan, step_s
    for name, make in timed.items():
        if name != "gds_only" and not baselines:
            continue
        if name != "dynamic_cp" and best_s <= sharded_floor:
            continue  # no all-sharded plan can beat the best so far: skip planning one
        if name == "dynamic_cp" and best_s <= dynamic_cp_floor(lengths, cost, degrees=degrees, labels=labels,
                                                               **shape):
            continue  # dynamic_cp's rules cannot beat it either
        candidate, candidate_s = make()
        if candidate_s < best_s:
            best, best_s = candidate, candidate_s
    return best


def _timed(planned: tuple[StepPlan, float | None]) -> tuple[StepPlan, float]:
    plan, step_s = planned
    assert step_s is not None  # refine=True
    return plan, step_s


def _simulated(plan: StepPlan, lengths: Sequence[int], cost: CostModel,
               labels: Sequence[int] | None) -> tuple[StepPlan, float]:
    return plan, simulate(plan, lengths, cost, labels=labels).step_s


def dynamic_cp_floor(lengths: Sequence[int], cost: CostModel, *, dp_size: int, cp_size: int,
                     bucket_size: int, degrees: str | Sequence[int],
                     labels: Sequence[int] | None = None) -> float:
    """A lower bound of dynamic_cp's modeled step (scheduling/dynamic_cp.py), without planning it.

    Its layout follows from the lengths alone (scheduling.dynamic_cp.dynamic_cp_layout: smallest fitting
    degree d_i, LPT by S^2, each DP rank's first micro-batch count), so for each DP rank's members M:
    every micro-batch costs each CP rank at least its compute plus b and k q (the ring only adds:
    overlapped(c, l) >= l), and a micro-batch's time is its busiest rank's, at least the mean over the N
    ranks; the sequences' compute sums to T_comp(sum F_i), a sequence sharded over d ranks adds
    d sharded_sequence_s(d), and there are at least the first count, ceil(sum d_i ceil(S_i/d_i) / (C N)),
    micro-batches. So step >= max over DP ranks of (T_comp(sum F) + sum d sharded_sequence_s(d)) / N +
    count b.
    """
    layout = dynamic_cp_layout(lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                               cp_degrees=degrees)
    flops = np.asarray(cost.sequence_flops(lengths, labels))
    per_degree = {d: d * cost.sharded_sequence_s(d) for d in set(layout.degree)}
    extra = np.array([per_degree[d] for d in layout.degree]) if layout.degree else np.zeros(0)
    overhead = cost.micro_batch_overhead_s(dp_size * cp_size)
    floor = 0.0
    for members, count in zip(layout.partition, layout.first_counts, strict=True):
        m = np.asarray(members, dtype=np.int64)
        rank_s = (cost.t_comp(float(flops[m].sum())) + float(extra[m].sum())) / cp_size + count * overhead
        floor = max(floor, rank_s)
    return floor


def all_sharded_floor(lengths: Sequence[int], cost: CostModel, *, dp_size: int, cp_size: int,
                      labels: Sequence[int] | None = None) -> float:
    """A lower bound of any all-sharded plan's step (same proof as scheduling.simulate's bounds).

    Every micro-batch of such a plan pays T_comm(V) >= the ring's latency floor T_comm(0+) in full (no
    local work to hide it under) and at least one sharded sequence's sharded_sequence_s(N), so step >=
    perfect-balance bound + those; and the longest sequence's micro-batch >= T_comm(V*) + T_comp(F*/N) +
    b + sharded_sequence_s(N).
    """
    flops = cost.sequence_flops(lengths, labels)
    bound = perfect_balance_bound(flops, cost, dp_size * cp_size)  # lower_bounds' first
    if cp_size <= 1 or not len(lengths):
        return bound
    heaviest = heaviest_sequence(flops, lengths)
    sequence_s = cost.sharded_sequence_s(cp_size)  # every micro-batch shards at least one sequence
    latency_floor = cost.t_comm(1.0, cp_size) + sequence_s
    alone = (cost.t_comm(cost.kv_bytes(float(lengths[heaviest])), cp_size)
             + cost.t_comp(flops[heaviest] / cp_size) + cost.micro_batch_overhead_s(dp_size * cp_size)
             + sequence_s)
    return max(bound + latency_floor, alone)
