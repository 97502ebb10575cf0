"""The `skrull` policy: GDS + DACP (+ refinement), with a whole-plan fallback to the GDS-only ablation.

    plan     = plan_gds(DACP per micro-batch)
    if step(plan) <= floor of any all-sharded plan:  return plan        (no GDS-only plan can be faster)
    fallback = plan_gds(execution="static")                             (GDS-only: every sequence sharded)
    return the faster of the two (ties keep the DACP plan)

Every GDS-only micro-batch is also a valid DACP output (all sharded), so Skrull may always fall back to
it; with that fallback Skrull's modeled step is never above GDS-only's. Planning it costs a fraction of
the DACP plan (no placement search), and the floor test skips it when it cannot win. The other ablations
are not planned here: DACP-only and round-robin use the same DACP machinery on worse DP splits /
placements and cost a full plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.cost import CostModel
from scheduling.gds import plan_gds
from scheduling.plans import StepPlan
from scheduling.simulate import lower_bounds, simulate


def skrull(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
           cost: CostModel, labels: Sequence[int] | None = None) -> StepPlan:
    """GDS + DACP (+ refinement), or the GDS-only plan when the cost model says that one is faster."""
    shape = {"dp_size": dp_size, "cp_size": cp_size, "bucket_size": bucket_size, "cost": cost,
             "labels": labels}
    plan = plan_gds(lengths, **shape)
    estimate = simulate(plan, lengths, cost, labels=labels)
    if estimate.step_s <= all_sharded_floor(lengths, cost, dp_size=dp_size, cp_size=cp_size, labels=labels):
        return plan  # no all-sharded plan can be faster: skip planning one
    fallback = plan_gds(lengths, execution="static", **shape)
    return fallback if simulate(fallback, lengths, cost, labels=labels).step_s < estimate.step_s else plan


def all_sharded_floor(lengths: Sequence[int], cost: CostModel, *, dp_size: int, cp_size: int,
                      labels: Sequence[int] | None = None) -> float:
    """A lower bound of any all-sharded plan's step (same proof as scheduling.simulate's bounds).

    Every micro-batch of such a plan pays T_comm(V) >= the ring's latency floor T_comm(0+) in full (no
    local work to hide it under), so step >= perfect-balance bound + that floor; and the longest
    sequence's micro-batch >= T_comm(V*) + T_comp(F*/N) + b.
    """
    bound, _ = lower_bounds(lengths, cost, dp_size=dp_size, cp_size=cp_size, labels=labels)
    if cp_size <= 1 or not len(lengths):
        return bound
    flops = cost.sequence_flops(lengths, labels)
    heaviest = max(range(len(lengths)), key=lambda i: (flops[i], int(lengths[i])))
    latency_floor = cost.t_comm(1.0, cp_size)
    alone = (cost.t_comm(cost.kv_bytes(float(lengths[heaviest])), cp_size)
             + cost.t_comp(flops[heaviest] / cp_size) + cost.micro_batch_overhead_s(dp_size * cp_size))
    return max(bound + latency_floor, alone)
