"""The baselines and ablations Skrull is compared with (`scheduling.policies` registers them by name).

| policy           | DP split              | micro-batches                        | inside a micro-batch  |
|------------------|-----------------------|--------------------------------------|-----------------------|
| static_cp        | data order, rank r::D | k consecutive sequences (k=1)        | all sharded           |
| static_cp_packed | data order, rank r::D | consecutive, packed to C per rank    | all sharded           |
| sorted           | LongAlign: sort, pack consecutive to C per rank, shuffle | all sharded           |
|                  | the groups (seeded), deal them round-robin to DP ranks   |                       |
| dacp_only        | data order, rank r::D | consecutive, packed to C*N tokens    | DACP + refinement     |

(roundrobin and gds_only are plan_gds options, skrull is scheduling.skrull.)

"All sharded" is DeepSpeed-style static CP: a DacpPlan with every index in `distributed`. The baselines
cannot re-split (their batching *is* the baseline), so they equalize micro-batch counts across DP ranks by
appending empty micro-batches, which the cost model charges the per-micro-batch cost b.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduling.cost import CostModel
from scheduling.dacp import all_sharded, dacp_assign
from scheduling.plans import DacpPlan, SchedulingError, StepPlan, shard_tokens


def _equalized(per_rank: list[list[DacpPlan]], cp_size: int) -> StepPlan:
    """Pad every DP rank with empty micro-batches up to the largest count (ZeRO-2 needs equal counts)."""
    count = max(1, max(len(r) for r in per_rank))
    return StepPlan(micro_batches=tuple(
        tuple(r) + (DacpPlan.empty(cp_size),) * (count - len(r)) for r in per_rank
    ))


def _pack_consecutive(indices: Sequence[int], cost_of: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy in-order packing: start a new group when the next item would exceed `budget`."""
    groups: list[list[int]] = []
    used = budget + 1
    for i in indices:
        if used + cost_of[i] > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += cost_of[i]
    return groups


def static_cp(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
              micro_batch: int = 1) -> StepPlan:
    """DeepSpeed static CP: data-order DP split, `micro_batch` sequences per micro-batch, all sharded."""
    if micro_batch < 1:
        raise SchedulingError(f"scheduling.static_cp_micro_batch must be >= 1, got {micro_batch}")
    per_rank = []
    for r in range(dp_size):
        mine = list(range(r, len(lengths), dp_size))
        plans = []
        for start in range(0, len(mine), micro_batch):
            plan = all_sharded(mine[start:start + micro_batch], lengths, cp_size, bucket_size)
            if plan is None:
                raise SchedulingError(
                    f"static CP micro-batch of {micro_batch} sequences overflows scheduling.bucket_size="
                    f"{bucket_size} per rank: lower scheduling.static_cp_micro_batch"
                )
            plans.append(plan)
        per_rank.append(plans)
    return _equalized(per_rank, cp_size)


def static_cp_packed(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int) -> StepPlan:
    """Static CP with micro-batches packed in data order up to C tokens of shards per rank."""
    shards = [shard_tokens(int(s), cp_size) for s in lengths]
    per_rank = []
    for r in range(dp_size):
        groups = _pack_consecutive(range(r, len(lengths), dp_size), shards, bucket_size)
        per_rank.append([DacpPlan(local=((),) * cp_size, distributed=tuple(g)) for g in groups])
    return _equalized(per_rank, cp_size)


def sorted_batching(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
                    seed: int = 0) -> StepPlan:
    """LongAlign sorted batching: sort by length, pack consecutive groups, shuffle groups, deal them out."""
    shards = [shard_tokens(int(s), cp_size) for s in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (int(lengths[i]), i))
    groups = _pack_consecutive(order, shards, bucket_size)
    groups += [[] for _ in range(-len(groups) % dp_size)]
    permutation = np.random.default_rng(seed).permutation(len(groups))
    per_rank: list[list[DacpPlan]] = [[] for _ in range(dp_size)]
    for slot, g in enumerate(permutation):
        per_rank[slot % dp_size].append(DacpPlan(local=((),) * cp_size, distributed=tuple(groups[g])))
    return _equalized(per_rank, cp_size)


def _dacp_split(members: list[int], lengths: Sequence[int], flops: Sequence[float], cp_size: int,
                bucket_size: int, cost: CostModel) -> list[DacpPlan]:
    """DACP on a packed group; halve the group (in order) when DACP cannot place it."""
    state = dacp_assign(sorted(members, key=lambda i: (int(lengths[i]), i)), lengths, flops,
                        cp_size=cp_size, bucket_size=bucket_size, cost=cost)
    if state is not None:
        return [state.to_plan()]
    half = len(members) // 2  # len >= 2 here: a single sequence <= C*N always places
    return (_dacp_split(members[:half], lengths, flops, cp_size, bucket_size, cost)
            + _dacp_split(members[half:], lengths, flops, cp_size, bucket_size, cost))


def dacp_only(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
              cost: CostModel, labels: Sequence[int] | None = None) -> StepPlan:
    """Ablation: data-order split, in-order packing to C*N tokens, DACP inside each micro-batch."""
    flops = cost.sequence_flops(lengths, labels)
    sizes = [int(s) for s in lengths]
    per_rank = []
    for r in range(dp_size):
        groups = _pack_consecutive(range(r, len(lengths), dp_size), sizes, bucket_size * cp_size)
        per_rank.append([p for g in groups
                         for p in _dacp_split(g, lengths, flops, cp_size, bucket_size, cost)])
    return _equalized(per_rank, cp_size)
