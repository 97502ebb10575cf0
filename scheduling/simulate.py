"""Modeled iteration time of any StepPlan under a CostModel (+ its HardwareProfile).

For CP rank j of one micro-batch (the DACP overlap formula, DESIGN.md section 3):

    Time_j = max(T_comm(V), T_comp(Local_j)) + T_comp(Dist) + b

    micro-batch time = max_j Time_j            (CP ranks synchronize in the ring / the backward)
    DP rank time     = sum over its micro-batches
    step time        = max over DP ranks       (gradient reduction waits for the slowest)

The perfect-balance bound spreads the total FLOPs over all D*N ranks with no communication and one
micro-batch: T_comp(sum F / (D*N)) + b. No schedule can beat it under this cost model, so
bound_ratio = step / bound >= 1 measures what a plan leaves on the table.

Imbalances are max/mean: dp_imbalance over the DP ranks' times; cp_imbalance = sum over micro-batches of
max_j Time_j over sum of mean_j Time_j, i.e. the time CP groups spend waiting for their slowest rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduling.cost import CostModel
from scheduling.plans import DacpPlan, StepPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEstimate:
    """Modeled times (seconds) of one StepPlan."""

    step_s: float
    bound_s: float
    dp_rank_s: tuple[float, ...]
    """Per DP rank: sum over its micro-batches of the micro-batch time."""
    rank_busy_s: tuple[tuple[float, ...], ...]
    """Per DP rank, per CP rank: sum over micro-batches of Time_j (what a per-rank plot shows)."""
    cp_imbalance: float
    distributed_token_fraction: float
    num_micro_batches: int

    @property
    def bound_ratio(self) -> float:
        return self.step_s / self.bound_s

    @property
    def dp_imbalance(self) -> float:
        return max(self.dp_rank_s) / (sum(self.dp_rank_s) / len(self.dp_rank_s))


def rank_times(plan: DacpPlan, lengths: Sequence[int], flops: Sequence[float],
               cost: CostModel) -> list[float]:
    """Time_j of every CP rank j of one micro-batch."""
    n = plan.cp_size
    dist_flops = sum(flops[i] for i in plan.distributed) / n
    volume = sum(cost.kv_bytes(float(lengths[i])) for i in plan.distributed)
    comm = cost.t_comm(volume, n)
    tail = cost.t_comp(dist_flops) + cost.profile.micro_batch_overhead_s
    return [max(comm, cost.t_comp(sum(flops[i] for i in rank))) + tail for rank in plan.local]


def simulate(step: StepPlan, lengths: Sequence[int], cost: CostModel) -> StepEstimate:
    """Model one step; `lengths` is the global batch the plan's indices refer to."""
    flops = cost.flops(np.asarray(lengths, dtype=np.float64)).tolist()
    dp_times, busy = [], []
    worst_total = mean_total = 0.0
    for rank in step.micro_batches:
        per_cp = [0.0] * step.cp_size
        total = 0.0
        for mb in rank:
            times = rank_times(mb, lengths, flops, cost)
            total += max(times)
            worst_total += max(times)
            mean_total += sum(times) / len(times)
            per_cp = [a + b for a, b in zip(per_cp, times, strict=True)]
        dp_times.append(total)
        busy.append(tuple(per_cp))
    num_ranks = step.dp_size * step.cp_size
    bound = cost.t_comp(sum(flops) / num_ranks) + cost.profile.micro_batch_overhead_s
    tokens = sum(int(s) for s in lengths)
    distributed = sum(int(lengths[i]) for r in step.micro_batches for mb in r for i in mb.distributed)
    return StepEstimate(
        step_s=max(dp_times), bound_s=bound, dp_rank_s=tuple(dp_times), rank_busy_s=tuple(busy),
        cp_imbalance=worst_total / mean_total, distributed_token_fraction=distributed / max(tokens, 1),
        num_micro_batches=step.num_micro_batches,
    )
