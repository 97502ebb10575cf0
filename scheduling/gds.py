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
   Our addition: when the strided split does not fit, a balanced packing into the same m is tried
   (longest first, each to the micro-batch with the fewest tokens that has room). The strided split alone
   fails on any batch holding a sequence that nearly fills C*N tokens: short sequences are dealt beside
   it at every m, so m grew to one sequence per micro-batch (32 micro-batches for 32 sequences, measured
   by `bench train` on configs/bench/cpu-lmsys.yaml, where packing needs ~8). With a cost model the
   packing is also kept when it models faster than a strided split that fits.
3. Equal micro-batch counts: ZeRO-2 reduces gradients inside every backward, so every DP rank must run
   the same number of micro-batches (docs/design.md §9). We *re-split* every rank to the largest count M
   (strided again with m = M, growing M if some rank's re-split fails) rather than append empty
   micro-batches: the worker pays the per-micro-batch cost b either way, but re-splitting spreads the
   lighter ranks' tokens thinner, so DACP keeps more sequences local (less ring traffic) and peak memory
   drops; an empty micro-batch would buy nothing for the same b. Empty micro-batches appear only when a
   rank has fewer sequences than M.

4. Modeled-time choices (with a cost model and refine=True; our extension beyond the paper):
   - a micro-batch whose DACP plan models slower than sharding everything, or on which Algorithm 1's
     roll-back gives up while all-sharded still fits, is planned all-sharded (a valid DACP output);
   - after the first fit M, the common counts M+1 .. M+EXTRA_COUNTS are planned too while the lower
     bound max_r floor_r + M'*b is below the best step so far, and the fastest is kept.

`execution="static"` (the GDS-only ablation) shards every sequence instead of running DACP: a micro-batch
then fits when sum(ceil(S/N)) <= C.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from scheduling.cost import CostModel
from scheduling.dacp import all_sharded, check_fits, dacp_assign
from scheduling.plans import DacpPlan, SchedulingError, StepPlan
from scheduling.simulate import rank_times

EXECUTIONS = ("dacp", "static")
EXTRA_COUNTS = 2
"""How many common micro-batch counts above the first fit GDS tries (kept when modeled faster)."""


def lpt_bins(flops: Sequence[float], num_bins: int) -> list[list[int]]:
    """Longest-processing-time-first: heaviest item to the lightest bin; deterministic ties."""
    heap = [(0.0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for index in sorted(range(len(flops)), key=lambda i: (-flops[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(index)
        heapq.heappush(heap, (load + flops[index], b))
    return bins


class _RankSplitter:
    """Strided micro-batching of one DP rank's bin, planning each micro-batch with DACP or static CP."""

    def __init__(self, bin_: list[int], lengths: Sequence[int], flops: Sequence[float], *, cp_size: int,
                 bucket_size: int, placement: str, execution: str, cost: CostModel | None,
                 world: int = 1) -> None:
        self.bin = sorted(bin_, key=lambda i: (int(lengths[i]), i))
        self.lengths, self.flops = lengths, flops
        self.cp_size, self.bucket_size = cp_size, bucket_size
        self.placement, self.execution, self.cost = placement, execution, cost
        self.world = world
        """DP x CP ranks the gradients are reduced over (sizes the per-micro-batch cost b)."""

    def first_count(self) -> int:
        total = sum(int(self.lengths[i]) for i in self.bin)
        return max(1, -(-total // (self.bucket_size * self.cp_size)))

    def split(self, count: int) -> list[DacpPlan] | None:
        """`count` micro-batches: the strided split, or the balanced packing when that one does not fit
        (with a cost model: whichever of the two models faster); None if neither fits."""
        strided = self._planned([self.bin[j::count] for j in range(count)])
        if strided is not None and self.cost is None:
            return strided
        groups = self._packed(count)
        packed = None if groups is None else self._planned(groups)
        if strided is None or packed is None:
            return strided or packed
        return packed if self.split_time(packed) < self.split_time(strided) else strided

    def _packed(self, count: int) -> list[list[int]] | None:
        """Longest first, each sequence to the micro-batch holding the fewest tokens that still has room
        for it within C*N (None when a sequence finds none): the strided split puts short sequences beside
        one that fills a micro-batch (it then grows the count up to one sequence per micro-batch), this
        packing never does."""
        capacity = self.bucket_size * self.cp_size
        members: list[list[int]] = [[] for _ in range(count)]
        tokens = [0] * count
        for i in sorted(self.bin, key=lambda i: (-int(self.lengths[i]), i)):
            length = int(self.lengths[i])
            room = [j for j in range(count) if tokens[j] + length <= capacity]
            if not room:
                return None
            j = min(room, key=lambda j: (tokens[j], j))
            members[j].append(i)
            tokens[j] += length
        return [sorted(m, key=lambda i: (int(self.lengths[i]), i)) for m in members]

    def _planned(self, groups: list[list[int]]) -> list[DacpPlan] | None:
        """Each group planned as one micro-batch, or None if one of them does not fit."""
        if any(sum(int(self.lengths[i]) for i in g) > self.bucket_size * self.cp_size for g in groups):
            return None
        plans = []
        for members in groups:
            if not members:
                plans.append(DacpPlan.empty(self.cp_size))
                continue
            plan = self._plan(members)
            if plan is None:
                return None
            plans.append(plan)
        return plans

    def _plan(self, members: list[int]) -> DacpPlan | None:
        static = all_sharded(members, self.lengths, self.cp_size, self.bucket_size)
        if self.execution == "static":
            return static
        state = dacp_assign(members, self.lengths, self.flops, cp_size=self.cp_size,
                            bucket_size=self.bucket_size, placement=self.placement, cost=self.cost)
        if self.cost is None:  # the paper's Algorithm 1 alone (the round-robin ablation): no fallback
            return None if state is None else state.to_plan()
        # All-sharded is a valid DACP output too. Algorithm 1's roll-back can give up (or leave a long
        # sequence local under memory pressure) where sharding everything still fits and runs faster:
        # keep whichever the cost model says is faster, so Skrull never needs more micro-batches than
        # GDS-only and never models slower on the same micro-batch.
        plan = None if state is None else state.to_plan()
        if plan is None or (static is not None and self.time(static) < self.time(plan)):
            return static
        return plan

    def time(self, plan: DacpPlan) -> float:
        """Modeled seconds of one micro-batch (max over its CP ranks)."""
        assert self.cost is not None
        return max(rank_times(plan, self.lengths, self.flops, self.cost, world=self.world))

    def split_time(self, plans: list[DacpPlan]) -> float:
        return sum(self.time(p) for p in plans) if self.cost is not None else 0.0

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
             bins: list[list[int]] | None = None, labels: Sequence[int] | None = None) -> StepPlan:
    """Plan one global batch: LPT over DP ranks, strided micro-batches, DACP per micro-batch.

    `refine` applies scheduling.refine to every DACP placement (refine=False: the paper's Algorithm 1).
    `bins` replaces step 1 with a given DP split (the DACP-only ablation passes the data-order split).
    `labels`: label tokens per sequence (the model cost formula's LM head; None: every token).
    """
    if dp_size < 1:
        raise SchedulingError(f"DP size must be >= 1 (parallel.num_workers / parallel.cp_size): {dp_size}")
    if execution not in EXECUTIONS:
        raise SchedulingError(f"GDS execution {execution!r} is not one of {EXECUTIONS}")
    check_fits(lengths, cp_size, bucket_size)
    flops = cost.sequence_flops(lengths, labels)
    if bins is None:
        bins = lpt_bins(flops, dp_size)
    splitters = [_RankSplitter(b, lengths, flops, cp_size=cp_size, bucket_size=bucket_size,
                               placement=placement, execution=execution,
                               cost=cost if refine else None, world=dp_size * cp_size) for b in bins]
    results = _equal_counts(splitters, [s.smallest_fit(s.first_count()) for s in splitters])
    if not refine:
        return _step(results)
    # GDS's first fit is the fewest micro-batches, which is not always the fastest: a larger common
    # count M can let DACP keep more sequences local or balance better. Try up to EXTRA_COUNTS more,
    # stopping once M alone is too slow: max_r floor_r + M*b lower-bounds any split into M, floor_r
    # being rank r's share of its FLOPs or its longest sequence alone (scheduling/simulate.py's proof).
    best, best_time = results, _step_time(splitters, results)
    floor = max(_rank_floor(b, lengths, flops, cost, cp_size) for b in bins if b)
    for extra in range(1, EXTRA_COUNTS + 1):
        count = results[0][0] + extra
        if floor + count * cost.micro_batch_overhead_s(dp_size * cp_size) >= best_time:
            break
        candidate = _equal_counts(splitters, [s.smallest_fit(count) for s in splitters])
        candidate_time = _step_time(splitters, candidate)
        if candidate_time < best_time * (1 - 1e-9):
            best, best_time = candidate, candidate_time
    return _step(best)


Split = tuple[int, list[DacpPlan]]


def _equal_counts(splitters: list[_RankSplitter], results: list[Split]) -> list[Split]:
    """Re-split every rank to the common (largest) count; grow it if some rank cannot take it."""
    target = max(count for count, _ in results)
    while True:
        for r, splitter in enumerate(splitters):
            if results[r][0] != target:
                results[r] = splitter.smallest_fit(target)
        new_target = max(count for count, _ in results)
        if new_target == target:
            return results
        target = new_target


def _rank_floor(members: list[int], lengths: Sequence[int], flops: Sequence[float], cost: CostModel,
                cp_size: int) -> float:
    """Seconds (without b) no split of one DP rank's sequences can beat (see scheduling.simulate)."""
    longest = max(members, key=lambda i: (flops[i], int(lengths[i])))
    heaviest = flops[longest]
    alone = min(cost.t_comp(heaviest), cost.t_comm(cost.kv_bytes(float(lengths[longest])), cp_size)
                + cost.t_comp(heaviest / cp_size))
    return max(cost.t_comp(sum(flops[i] for i in members) / cp_size), alone)


def _step_time(splitters: list[_RankSplitter], results: list[Split]) -> float:
    return max(s.split_time(plans) for s, (_, plans) in zip(splitters, results, strict=True))


def _step(results: list[Split]) -> StepPlan:
    return StepPlan(micro_batches=tuple(tuple(plans) for _, plans in results))
