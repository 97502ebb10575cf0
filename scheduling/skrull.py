"""The `skrull` policy: GDS + DACP (+ refinement), with a whole-plan fallback to the GDS-only ablation.

    plan     = plan_gds(DACP per micro-batch)
    if step(plan) <= floor of any all-sharded plan:  return plan        (no GDS-only plan can be faster)
    fallback = plan_gds(execution=static)                              (GDS-only: every sequence sharded)
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
from scheduling.gds import Execution, plan_gds_timed
from scheduling.plans import StepPlan
from scheduling.simulate import heaviest_sequence, perfect_balance_bound


def skrull(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
           cost: CostModel, labels: Sequence[int] | None = None,
           cp_degrees: str | Sequence[int] | None = None) -> StepPlan:
    """GDS + DACP (+ refinement), or the GDS-only plan when the cost model says that one is faster.

    `cp_degrees` (scheduling.cp_degrees; None: [1, N]) reaches DACP only: the GDS-only fallback shards
    every sequence over the whole CP group, as the GDS-only ablation does."""
    shape = {"dp_size": dp_size, "cp_size": cp_size, "bucket_size": bucket_size, "cost": cost,
             "labels": labels}
    # plan_gds_timed's step time is simulate(plan).step_s, from the micro-batch times GDS compared
    plan, step_s = plan_gds_timed(lengths, cp_degrees=cp_degrees, **shape)
    assert step_s is not None  # refine=True: GDS modeled every micro-batch
    if step_s <= all_sharded_floor(lengths, cost, dp_size=dp_size, cp_size=cp_size, labels=labels):
        return plan  # no all-sharded plan can be faster: skip planning one
    fallback, fallback_s = plan_gds_timed(lengths, execution=Execution.STATIC, **shape)
    assert fallback_s is not None
    return fallback if fallback_s < step_s else plan


def all_sharded_floor(lengths: Sequence[int], cost: CostModel, *, dp_size: int, cp_size: int,
                      labels: Sequence[int] | None = None) -> float:
    """A lower bound of any all-sharded plan's step (same proof as scheduling.simulate's bounds).

    Every micro-batch of such a plan pays T_comm(V) >= the ring's latency floor T_comm(0+) in full (no
    local work to hide it under), so step >= perfect-balance bound + that floor; and the longest
    sequence's micro-batch >= T_comm(V*) + T_comp(F*/N) + b.
    """
    flops = cost.sequence_flops(lengths, labels)
    bound = perfect_balance_bound(flops, cost, dp_size * cp_size)  # lower_bounds' first
    if cp_size <= 1 or not len(lengths):
        return bound
    heaviest = heaviest_sequence(flops, lengths)
    latency_floor = cost.t_comm(1.0, cp_size)
    alone = (cost.t_comm(cost.kv_bytes(float(lengths[heaviest])), cp_size)
             + cost.t_comp(flops[heaviest] / cp_size) + cost.micro_batch_overhead_s(dp_size * cp_size))
    return max(bound + latency_floor, alone)
