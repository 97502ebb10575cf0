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

5. Per-sequence CP degrees (`cp_degrees` beyond [1, N], docs/design.md §13; with a cost model and
   refine=True), after steps 1-4 chose the split at [1, N]: DP ranks from the slowest down, every
   micro-batch of the rank is also placed by scheduling.dacp_degrees (each sequence at degree 1, N or a
   power of two in between, on an aligned subgroup) and that placement replaces the two-level one only
   when it models strictly faster; the pass stops at the first rank whose two-level time is at most the
   slowest re-placed rank's (it cannot set the step any more). A micro-batch is skipped when its
   two-level placement models within MIXED_GAP of its lower bound (dacp_degrees.micro_batch_floor), or
   keeps every sequence whole with none heavier than a CP rank's fair share (sum F / N): nothing a ring
   would balance. The split, counts and every other micro-batch are the two-level plan's, and every
   replaced micro-batch models faster, so the step never models slower than [1, N]'s. Re-placing the
   critical ranks only (not every trial micro-batch inside the split search) keeps the planner's latency:
   measured on 7B / ChatQA2 (CP=16, h100) it gives up ~1% of the modeled gain of planning every trial
   micro-batch with all degrees (16.63 s against 16.46 s over four batches, 23.0 s at [1, N]) at a
   fraction of the cost (docs/benchmarks.md). [1, N] (or None) skips step 5: the paper's two-level DACP.

`execution=Execution.STATIC` (the GDS-only ablation) shards every sequence instead of running DACP: a
micro-batch then fits when sum(ceil(S/N)) <= C.

Speed: one rank's splitter plans the same group of sequences many times (the strided split and the
packing coincide at m = 1; the equal-count pass and the extra counts re-split to counts already tried),
and each plan is deterministic in its group, so every group is planned once (memoized) together with its
modeled time. Trial micro-batches stay plain lists; DacpPlans are built for the kept plan only. The batch's
per-sequence numbers (scheduling.dacp_state.SequenceTable) and the cost Clock are computed once.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from enum import StrEnum

from scheduling.cost import Clock, CostModel, SubgroupClock
from scheduling.dacp import Placement, check_fits, dacp_assign
from scheduling.dacp_degrees import assign_degrees, is_two_level, micro_batch_floor, resolve_cp_degrees
from scheduling.dacp_state import SequenceTable
from scheduling.plans import DacpPlan, SchedulingError, StepPlan, SubgroupShards
from scheduling.simulate import alone_floor, micro_batch_time


class Execution(StrEnum):
    """How a micro-batch runs: DACP (local sequences whole, long ones sharded) or static (all sharded)."""

    DACP = "dacp"
    STATIC = "static"


EXECUTIONS = tuple(Execution)
MIXED_GAP = 1 + 5e-3
"""Step 5 leaves a micro-batch two-level when that plan models within this factor of the micro-batch's lower
bound: the per-sequence-degree placement could gain < 0.5% there (measured on LMsysChat1M-like batches,
where every micro-batch sits within 0.12% of it and the mixed placement gained <= 0.01%), and skipping it
keeps the planner's latency (docs/benchmarks.md)."""
EXTRA_COUNTS = 2
"""How many common micro-batch counts above the first fit GDS tries (kept when modeled faster)."""


def lpt_bins(flops: Sequence[float], num_bins: int, table: SequenceTable | None = None) -> list[list[int]]:
    """Longest-processing-time-first: heaviest item to the lightest bin; deterministic ties.

    `table` (a SequenceTable over all of these flops) supplies that order already sorted."""
    heap = [(0.0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    order = sorted(range(len(flops)), key=lambda i: (-flops[i], i)) if table is None else table.weight_order
    for index in order:
        load, b = heap[0]  # the lightest bin (ties to the lowest id); (load, id) pairs are unique
        bins[b].append(index)
        heapq.heapreplace(heap, (load + flops[index], b))
    return bins


class _Trial:
    """One planned micro-batch (a DACP placement or all sharded) and its modeled time, before any DacpPlan
    is built: GDS plans many micro-batches it discards. `partial`: (degree, group, indices) entries of a
    placement with per-sequence CP degrees (scheduling.dacp_degrees), empty in two-level ones."""

    __slots__ = ("distributed", "local", "partial", "time")

    def __init__(self, local: Sequence[Sequence[int]], distributed: Sequence[int], time: float,
                 partial: Sequence[tuple[int, int, Sequence[int]]] = ()) -> None:
        self.local, self.distributed, self.time, self.partial = local, distributed, time, partial

    def plan(self) -> DacpPlan:
        partial = tuple(SubgroupShards(degree=d, group=g, indices=tuple(members))
                        for d, g, members in self.partial)
        return DacpPlan(local=tuple(tuple(rank) for rank in self.local), distributed=tuple(self.distributed),
                        partial=partial)


class _RankSplitter:
    """Strided micro-batching of one DP rank's bin, planning each micro-batch with DACP or static CP."""

    def __init__(self, bin_: list[int], lengths: Sequence[int], flops: Sequence[float], *, cp_size: int,
                 bucket_size: int, placement: Placement, execution: Execution, cost: CostModel | None,
                 table: SequenceTable, clock: Clock, degrees: Sequence[int] = (),
                 subgroups: SubgroupClock | None = None) -> None:
        self.bin = sorted(bin_, key=table.length_rank.__getitem__)  # ascending (S, index)
        self.lengths, self.flops, self.table, self.clock = lengths, flops, table, clock
        self.cp_size, self.bucket_size = cp_size, bucket_size
        self.placement, self.execution, self.cost = placement, execution, cost
        self._groups: dict[tuple[int, ...], _Trial | None] = {}
        # per-sequence CP degrees (step 5, after the split): with a cost model and degrees beyond (1, N)
        self.degrees, self.subgroups = degrees, subgroups if cost is not None else None
        self._splits: dict[int, list[_Trial] | None] = {}

    def first_count(self) -> int:
        lens = self.table.lengths
        total = sum(map(lens.__getitem__, self.bin))
        return max(1, -(-total // (self.bucket_size * self.cp_size)))

    def split(self, count: int) -> list[_Trial] | None:
        """`count` micro-batches: the strided split, or the balanced packing when that one does not fit
        (with a cost model: whichever of the two models faster); None if neither fits."""
        if count not in self._splits:
            self._splits[count] = self._split(count)
        return self._splits[count]

    def _split(self, count: int) -> list[_Trial] | None:
        strided = self._planned([self.bin[j::count] for j in range(count)])
        if count == 1 or (strided is not None and self.cost is None):
            return strided  # one micro-batch: the packing is the same group (the whole sorted bin)
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
        lens, by_length = self.table.lengths, self.table.length_rank.__getitem__
        members: list[list[int]] = [[] for _ in range(count)]
        tokens = [0] * count
        for i in sorted(self.bin, key=lambda i: (-lens[i], i)):  # longest first, ties to the lowest index
            length = lens[i]
            j = tokens.index(min(tokens))  # the fewest tokens has the most room: if not there, nowhere
            if tokens[j] + length > capacity:
                return None
            members[j].append(i)
            tokens[j] += length
        return [sorted(m, key=by_length) for m in members]

    def _planned(self, groups: list[list[int]]) -> list[_Trial] | None:
        """Each group planned as one micro-batch, or None if one of them does not fit."""
        lens, capacity = self.table.lengths, self.bucket_size * self.cp_size
        if any(sum(map(lens.__getitem__, g)) > capacity for g in groups):
            return None
        trials = []
        for members in groups:
            key = tuple(members)
            if key not in self._groups:
                self._groups[key] = self._plan(members)
            trial = self._groups[key]
            if trial is None:
                return None
            trials.append(trial)
        return trials

    def _plan(self, members: list[int]) -> _Trial | None:
        """One micro-batch (an empty group is the empty micro-batch)."""
        n = self.cp_size
        if not members:
            return self._trial([[]] * n, [])
        shards = self.table.shards(n)
        fits_sharded = sum(map(shards.__getitem__, members)) <= self.bucket_size
        if self.execution == Execution.STATIC:
            return self._trial([[]] * n, members) if fits_sharded else None
        state = dacp_assign(members, self.lengths, self.flops, cp_size=n, bucket_size=self.bucket_size,
                            placement=self.placement, cost=self.cost, table=self.table)
        if self.cost is None:  # the paper's Algorithm 1 alone (the round-robin ablation): no fallback
            return None if state is None else self._trial(state.local, state.distributed)
        # All-sharded is a valid DACP output too. Algorithm 1's roll-back can give up (or leave a long
        # sequence local under memory pressure) where sharding everything still fits and runs faster:
        # keep whichever the cost model says is faster, so Skrull never needs more micro-batches than
        # GDS-only and never models slower on the same micro-batch.
        static = self._trial([[]] * n, members) if fits_sharded else None
        placed = None if state is None else self._trial(state.local, state.distributed)
        if placed is None or (static is not None and static.time < placed.time):
            return static
        return placed

    def _mixed(self, members: list[int], two_level: _Trial) -> _Trial:
        """Step 5 for one micro-batch: the per-sequence-degree placement when it models strictly faster
        than the two-level one (kept on ties; not planned when the two-level one is within MIXED_GAP of
        the micro-batch's lower bound, or keeps everything whole with no dominant sequence)."""
        assert self.subgroups is not None
        if not two_level.distributed:
            flops = self.table.flops
            heaviest = flops[min(members, key=self.table.weight_rank.__getitem__)]
            if heaviest * self.cp_size <= sum(map(flops.__getitem__, members)):
                return two_level  # all whole, none dominant: nothing a ring would help balance
        if two_level.time <= micro_batch_floor(members, self.table, self.subgroups, self.degrees) * MIXED_GAP:
            return two_level  # nothing (or almost nothing: < MIXED_GAP) left to gain
        best: _Trial = two_level
        for fewest_ranks in (False, True):  # the greedy, and each sequence on the fewest ranks it fits
            mixed = assign_degrees(members, self.table, cp_size=self.cp_size, bucket_size=self.bucket_size,
                                   degrees=self.degrees, clock=self.subgroups, fewest_ranks=fewest_ranks)
            if mixed is not None and mixed.time < best.time:
                best = _Trial(mixed.local, mixed.distributed, mixed.time, mixed.partial)
        return best

    def _trial(self, local: Sequence[Sequence[int]], distributed: Sequence[int]) -> _Trial:
        """A micro-batch with its modeled time (0 without a cost model, which never compares times)."""
        if self.cost is None:
            return _Trial(local, distributed, 0.0)
        return _Trial(local, distributed, micro_batch_time(local, distributed, self.table.flops,
                                                           self.table.kv, self.clock))

    def split_time(self, trials: list[_Trial]) -> float:
        return sum(t.time for t in trials) if self.cost is not None else 0.0

    def smallest_fit(self, start: int) -> tuple[int, list[_Trial]]:
        """The first count >= start whose split fits (always ends: len(bin) singletons fit)."""
        count = start
        while True:
            trials = self.split(count)
            if trials is not None:
                return count, trials
            if count >= max(1, len(self.bin)):
                raise SchedulingError(  # only reachable if check_fits was bypassed
                    "GDS could not fit single-sequence micro-batches: raise scheduling.bucket_size"
                )
            count += 1


def plan_gds(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int, cost: CostModel,
             placement: Placement = Placement.GREEDY, execution: Execution = Execution.DACP,
             refine: bool = True,
             bins: list[list[int]] | None = None, labels: Sequence[int] | None = None,
             cp_degrees: str | Sequence[int] | None = None) -> StepPlan:
    """Plan one global batch: LPT over DP ranks, strided micro-batches, DACP per micro-batch.

    `refine` applies scheduling.refine to every DACP placement (refine=False: the paper's Algorithm 1).
    `bins` replaces step 1 with a given DP split (the DACP-only ablation passes the data-order split).
    `labels`: label tokens per sequence (the model cost formula's LM head; None: every token).
    `cp_degrees`: scheduling.cp_degrees (None or [1, N]: the paper's two-level DACP; step 5).
    """
    return plan_gds_timed(lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size, cost=cost,
                          placement=placement, execution=execution, refine=refine, bins=bins,
                          labels=labels, cp_degrees=cp_degrees)[0]


def plan_gds_timed(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
                   cost: CostModel, placement: Placement = Placement.GREEDY,
                   execution: Execution = Execution.DACP, refine: bool = True,
                   bins: list[list[int]] | None = None, labels: Sequence[int] | None = None,
                   cp_degrees: str | Sequence[int] | None = None) -> tuple[StepPlan, float | None]:
    """plan_gds, and the plan's modeled step time: simulate(plan).step_s, summed the same way from the
    micro-batch times GDS already has (None with refine=False, which models no time)."""
    if dp_size < 1:
        raise SchedulingError(f"DP size must be >= 1 (parallel.num_workers / parallel.cp_size): {dp_size}")
    if execution not in EXECUTIONS:
        raise SchedulingError(f"GDS execution {execution!r} is not one of {', '.join(EXECUTIONS)}")
    check_fits(lengths, cp_size, bucket_size)
    flops = cost.sequence_flops(lengths, labels)
    table = SequenceTable(lengths, flops, cost)
    if bins is None:
        bins = lpt_bins(flops, dp_size, table)
    clock = cost.clock(cp_size, dp_size * cp_size)
    degrees = resolve_cp_degrees(cp_degrees, cp_size)
    mixed = execution == Execution.DACP and refine and not is_two_level(degrees, cp_size)
    splitters = [_RankSplitter(b, lengths, flops, cp_size=cp_size, bucket_size=bucket_size,
                               placement=placement, execution=execution, cost=cost if refine else None,
                               table=table, clock=clock, degrees=degrees if mixed else (),
                               subgroups=(SubgroupClock(cost, cp_size, dp_size * cp_size, dp) if mixed
                                          else None))
                 for dp, b in enumerate(bins)]
    results = _equal_counts(splitters, [s.smallest_fit(s.first_count()) for s in splitters])
    if not refine:
        return _step(results), None
    # GDS's first fit is the fewest micro-batches, which is not always the fastest: a larger common
    # count M can let DACP keep more sequences local or balance better. Try up to EXTRA_COUNTS more,
    # stopping once M alone is too slow: max_r floor_r + M*b lower-bounds any split into M, floor_r
    # being rank r's share of its FLOPs or its longest sequence alone (scheduling/simulate.py's proof).
    best, best_time = results, _step_time(splitters, results)
    floor = max(_rank_floor(b, table, cost, cp_size) for b in bins if b)
    for extra in range(1, EXTRA_COUNTS + 1):
        count = results[0][0] + extra
        if floor + count * cost.micro_batch_overhead_s(dp_size * cp_size) >= best_time:
            break
        candidate = _equal_counts(splitters, [s.smallest_fit(count) for s in splitters])
        candidate_time = _step_time(splitters, candidate)
        if candidate_time < best_time * (1 - 1e-9):
            best, best_time = candidate, candidate_time
    if mixed:
        best = _critical_degrees(splitters, best)
    return _step(best), _modeled_step(best)


Split = tuple[int, list[_Trial]]


def _critical_degrees(splitters: list[_RankSplitter], results: list[Split]) -> list[Split]:
    """Step 5 on the chosen split: DP ranks from the slowest down, every micro-batch placed with
    per-sequence degrees where that models faster, until the next rank's two-level time cannot set the
    step any more (it is at most the slowest re-placed rank's)."""
    totals = [s.split_time(trials) for s, (_, trials) in zip(splitters, results, strict=True)]
    out = list(results)
    done: list[float] = []
    for r in sorted(range(len(results)), key=lambda k: (-totals[k], k)):
        if done and max(done) >= totals[r]:
            break
        count, trials = results[r]
        placed = []
        for trial in trials:
            members = _members(trial)
            placed.append(splitters[r]._mixed(members, trial) if members else trial)  # empty: as it is
        out[r] = (count, placed)
        done.append(splitters[r].split_time(placed))
    return out


def _members(trial: _Trial) -> list[int]:
    return [i for rank in trial.local for i in rank] + list(trial.distributed)


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


def _rank_floor(members: list[int], table: SequenceTable, cost: CostModel, cp_size: int) -> float:
    """Seconds (without b) no split of one DP rank's sequences can beat (see scheduling.simulate).

    Its longest sequence is the first of `members` with the most FLOPs, then the most tokens."""
    flops, lens = table.flops, table.lengths
    heaviest = min(members, key=table.weight_rank.__getitem__)  # most FLOPs (ties: the lowest index)
    ties = [i for i in members if flops[i] == flops[heaviest]]
    longest = ties[0] if len(ties) == 1 else max(ties, key=lens.__getitem__)  # first of the longest
    heaviest = flops[longest]
    alone = alone_floor(cost, heaviest, cost.kv_bytes(float(lens[longest])), cp_size)
    return max(cost.t_comp(sum(map(flops.__getitem__, members)) / cp_size), alone)


def _step_time(splitters: list[_RankSplitter], results: list[Split]) -> float:
    return max(s.split_time(plans) for s, (_, plans) in zip(splitters, results, strict=True))


def _modeled_step(results: list[Split]) -> float:
    """simulate's step_s: per DP rank the micro-batch times accumulated in order, the slowest rank."""
    totals = []
    for _, trials in results:
        total = 0.0
        for trial in trials:
            total += trial.time
        totals.append(total)
    return max(totals)


def _step(results: list[Split]) -> StepPlan:
    return StepPlan(micro_batches=tuple(tuple(t.plan() for t in trials) for _, trials in results))
