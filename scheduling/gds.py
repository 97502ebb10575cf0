"""GDS, the paper's Algorithm 2: split a global batch over DP ranks and into micro-batches.

1. Bin-pack the K sequences over the D DP ranks by FLOPs, greedy longest-processing-time-first (the
   paper names no method; LPT is within 4/3 of the optimal makespan): heaviest first, each to the
   currently lightest rank (ties by rank id, so every process computes the same plan).
2. Per DP rank: sort its bin ascending, start at m = ceil(sum(S) / (C*N)) and take strided micro-batches

       bin (ascending) = [s0 s1 s2 s3 s4 s5 s6]        m = 3
       micro-batch 0   = [s0 s3 s6]    (bin[0::3])     each pairs short with long and
       micro-batch 1   = [s1 s4]       (bin[1::3])     spreads the longest sequences over
       micro-batch 2   = [s2 s5]       (bin[2::3])     different micro-batches

   Accept m when every micro-batch holds <= C*N tokens and DACP places it; else m += 1 (the GDS
   roll-back). m = len(bin) always succeeds (one sequence per micro-batch, S <= C*N checked up front).
3. Equal micro-batch counts: ZeRO-2 reduces gradients inside every backward, so every DP rank must run
   the same number of micro-batches (STACK_NOTES). We *re-split* every rank to the largest count M
   (strided again with m = M, growing M if some rank's re-split fails) rather than append empty
   micro-batches: the worker pays the per-micro-batch cost b either way, but re-splitting spreads the
   lighter ranks' tokens thinner, so DACP keeps more sequences local (less ring traffic) and peak memory
   drops; an empty micro-batch would buy nothing for the same b. Empty micro-batches appear only when a
   rank has fewer sequences than M.

`execution="static"` (the GDS-only ablation) shards every sequence instead of running DACP: a micro-batch
then fits when sum(ceil(S/N)) <= C.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from scheduling.cost import CostModel
from scheduling.dacp import check_fits, dacp_assign, state_to_plan
from scheduling.plans import DacpPlan, SchedulingError, StepPlan, shard_tokens

EXECUTIONS = ("dacp", "static")


def lpt_bins(flops: Sequence[float], num_bins: int) -> list[list[int]]:
    """Longest-processing-time-first: heaviest item to the lightest bin; deterministic ties."""
    heap = [(0.0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for index in sorted(range(len(flops)), key=lambda i: (-flops[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(index)
        heapq.heappush(heap, (load + flops[index], b))
    return bins


def static_micro_batch(indices: Sequence[int], lengths: Sequence[int], cp_size: int,
                       bucket_size: int) -> DacpPlan | None:
    """Every sequence sharded (static CP); None if the shards overflow one rank's bucket."""
    if sum(shard_tokens(int(lengths[i]), cp_size) for i in indices) > bucket_size:
        return None
    return DacpPlan(local=((),) * cp_size, distributed=tuple(indices))


class _RankSplitter:
    """Strided micro-batching of one DP rank's bin, planning each micro-batch with DACP or static CP."""

    def __init__(self, bin_: list[int], lengths: Sequence[int], flops: Sequence[float], *, cp_size: int,
                 bucket_size: int, placement: str, execution: str, cost: CostModel | None) -> None:
        self.bin = sorted(bin_, key=lambda i: (int(lengths[i]), i))
        self.lengths, self.flops = lengths, flops
        self.cp_size, self.bucket_size = cp_size, bucket_size
        self.placement, self.execution, self.cost = placement, execution, cost

    def first_count(self) -> int:
        total = sum(int(self.lengths[i]) for i in self.bin)
        return max(1, -(-total // (self.bucket_size * self.cp_size)))

    def split(self, count: int) -> list[DacpPlan] | None:
        """The `count` strided micro-batches, or None if one of them does not fit."""
        plans = []
        for j in range(count):
            members = self.bin[j::count]
            if not members:
                plans.append(DacpPlan.empty(self.cp_size))
                continue
            if sum(int(self.lengths[i]) for i in members) > self.bucket_size * self.cp_size:
                return None
            plan = self._plan(members)
            if plan is None:
                return None
            plans.append(plan)
        return plans

    def _plan(self, members: list[int]) -> DacpPlan | None:
        if self.execution == "static":
            return static_micro_batch(members, self.lengths, self.cp_size, self.bucket_size)
        state = dacp_assign(members, self.lengths, self.flops, cp_size=self.cp_size,
                            bucket_size=self.bucket_size, placement=self.placement, cost=self.cost)
        return None if state is None else state_to_plan(state)

    def smallest_fit(self, start: int) -> tuple[int, list[DacpPlan]]:
        """The first count >= start whose split fits (always ends: len(bin) singletons fit)."""
        count = start
        while True:
            plans = self.split(count)
            if plans is not None:
                return count, plans
            if count >= max(1, len(self.bin)):
                raise SchedulingError(  # only reachable if check_fits was bypassed
                    "GDS could not fit single-sequence micro-batches: raise scheduling.bucket_size"
                )
            count += 1


def plan_gds(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int, cost: CostModel,
             placement: str = "greedy", execution: str = "dacp", refine: bool = True,
             bins: list[list[int]] | None = None) -> StepPlan:
    """Plan one global batch: LPT over DP ranks, strided micro-batches, DACP per micro-batch.

    `refine` applies scheduling.refine to every DACP placement (refine=False: the paper's Algorithm 1).
    `bins` replaces step 1 with a given DP split (the DACP-only ablation passes the data-order split).
    """
    if dp_size < 1:
        raise SchedulingError(f"DP size must be >= 1 (parallel.num_workers / parallel.cp_size): {dp_size}")
    if execution not in EXECUTIONS:
        raise SchedulingError(f"GDS execution {execution!r} is not one of {EXECUTIONS}")
    check_fits(lengths, cp_size, bucket_size)
    flops = cost.flops(np.asarray(lengths, dtype=np.float64)).tolist()
    if bins is None:
        bins = lpt_bins(flops, dp_size)
    splitters = [_RankSplitter(b, lengths, flops, cp_size=cp_size, bucket_size=bucket_size,
                               placement=placement, execution=execution,
                               cost=cost if refine else None) for b in bins]
    results = [s.smallest_fit(s.first_count()) for s in splitters]
    target = max(count for count, _ in results)
    while True:  # re-split every rank to the common count; grow it if some rank cannot take it
        for r, splitter in enumerate(splitters):
            if results[r][0] != target:
                results[r] = splitter.smallest_fit(target)
        new_target = max(count for count, _ in results)
        if new_target == target:
            break
        target = new_target
    return StepPlan(micro_batches=tuple(tuple(plans) for _, plans in results))
