"""Cost-model refinement of a DACP placement (our extension beyond the paper's Algorithm 1).

Algorithm 1 shards a sequence only under memory pressure and places local sequences shortest-first, so a
micro-batch whose longest sequence alone outweighs a rank's fair share ends up with one rank doing most
of the work, and the last (longest) local sequences pile up on whichever ranks were lightest when they
arrived. The DACP objective itself (minimize max_j Time_j, docs/design.md §3) is what we refine against:

    Time = max_j max(T_comm(V), T_comp(Local_j)) + T_comp(Dist)

1. Local search from Algorithm 1's placement. On the rank r with the largest local load (and the rank
   `low` with the smallest) try, for each local sequence s of r,
       move:        s to `low` (if it fits there)
       swap:        s with a lighter local sequence t of `low` (if both still fit)
       distribute:  s becomes sharded (if every other rank can take ceil(S/N) tokens)
   Distributing is taken when it lowers the modeled Time and beats the best exchange; a move or swap
   is taken when it lowers the busier of the pair (max(L_r', L_low') < L_r), even if another rank
   keeps the global maximum where it is: that walks across the plateaus a "global max must drop" rule
   gets stuck on (after a dominant sequence is sharded, its old rank is empty and one move can never
   lower the max of the other N-1 ranks). Each exchange lowers sum_j L_j^2, so none repeats.
2. Starts: the local search runs from the local sequences re-placed longest-processing-time-first
   (heaviest first, each to the least loaded rank that still has room; the distributed set stays), and
   from Algorithm 1's own placement unless the first already reached the floor T_comp(F / N); the
   faster is kept. LPT is skipped when some sequence finds no rank with room.
3. Sharding chain: while the heaviest local sequence alone exceeds a rank's fair share of the local
   work, shard it, re-place the rest by LPT and search again, keeping the fastest state seen (a chain,
   since two dominant sequences may both have to be sharded before the ring traffic pays off). The
   chain stops early once T_comm(V) + T_comp(Dist) of the next state's distributed set alone reaches the
   best time: sharding only adds to both, so nothing further down could be kept (`_chain_bound`).

Every step lowers Time strictly and keeps every rank within C tokens, so Algorithm 1's guarantees
(every index once, memory) survive; the local search is bounded (4 x (sequences + 1) steps).
Moves go through scheduling.dacp_state (relocate, shard_local: the same moves Algorithm 1 makes); the
local search also caches Time's terms (local load per rank, shard load, ring volume).

Speed (GDS refines hundreds of trial micro-batches per batch, docs/design.md §4): per-sequence numbers
come from the batch's SequenceTable (tokens, FLOPs, F/N, K/V bytes, ceil(S/N), the heaviest-first order)
and times from a cost Clock, both computed once; every float is computed with the operations, in the
order, of the plain formulas, so the search takes the same steps and returns the same placement.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from itertools import chain

from scheduling.cost import Clock, CostModel
from scheduling.dacp_state import DacpState, SequenceTable

Step = tuple[float, str, int, int, int, int]
"""(new time, op, sequence, source rank, target rank, swap partner or -1)."""

_SLACK = 1 - 1e-9
"""A step must lower what it improves by more than this relative margin (float noise is no gain)."""


class _Refiner:
    def __init__(self, state: DacpState, table: SequenceTable, clock: Clock) -> None:
        self.state, self.table, self.clock = state, table, clock
        self.n = n = len(state.remaining)
        flops, kv = table.flops, table.kv
        self.shards, self.shard_flops = table.shards(n), table.shard_flops(n)
        # the objective's terms, kept in step with every move: the state's L mixes local and shard load
        self.local_load = [sum(map(flops.__getitem__, rank)) for rank in state.local]
        self.dist = sum(map(flops.__getitem__, state.distributed)) / n
        self.volume = sum(map(kv.__getitem__, state.distributed))
        self.num_dist = len(state.distributed)
        self.comm = clock.comm(self.volume)  # T_comm(volume), recomputed when the volume changes

    @property
    def current(self) -> float:
        return self.clock.objective(self.comm, max(self.local_load), self.dist, self.num_dist)

    def _best_exchange(self, r: int, low: int) -> tuple[float, int, int] | None:
        """Lowest max(L_r', L_low', 0) reachable by one move (t=-1) or swap (s <-> t) from r to low;
        ties keep the first candidate in the order (s of r in order, its move, then its swaps).

        The inner loop runs for every pair of the two ranks' sequences at every step, so max() is written
        out (the same result: the first of the largest)."""
        loads, remaining = self.local_load, self.state.remaining
        lengths, flops = self.table.lengths, self.table.flops
        load_r, load_low, room_low, room_r = loads[r], loads[low], remaining[low], remaining[r]
        partners = self.state.local[low]
        best = None
        best_peak = math.inf
        for s in self.state.local[r]:
            f_s, len_s = flops[s], lengths[s]
            if load_r - f_s >= best_peak:
                # every candidate of s keeps at least L_r - F_s on r (a swap takes back F_t >= 0; float
                # rounding is monotone, so this holds for the computed peaks too): none can beat the best
                continue
            if room_low >= len_s:
                peak = max(load_r - f_s, load_low + f_s, 0.0)
                if peak < best_peak or best is None:
                    best, best_peak = (peak, s, -1), peak
            for t in partners:
                delta = f_s - flops[t]
                if delta <= 0:
                    continue
                grow = len_s - lengths[t]
                if room_low < grow or room_r < -grow:
                    continue
                peak = load_r - delta
                other = load_low + delta
                if other > peak:
                    peak = other
                if peak < 0.0:
                    peak = 0.0
                if peak < best_peak or best is None:
                    best, best_peak = (peak, s, t), peak
        return best

    def best_step(self) -> Step | None:
        """The best candidate of the busiest rank (see the module docstring), or None."""
        loads, n, clock = self.local_load, self.n, self.clock
        ordered = sorted(loads)
        # loads the candidates leave untouched: all but r (distribute), all but r and low (move, swap);
        # for n >= 3 the second is the first (dropping one smallest load from >= 2 keeps their max)
        top, rest_r = ordered[-1], ordered[-2]  # n >= 2 here (refine returns early otherwise)
        r = loads.index(top)
        low = loads.index(ordered[0])
        dist = self.dist
        num_dist = self.num_dist
        threshold = clock.objective(self.comm, top, dist, num_dist) * _SLACK
        best: Step | None = None
        gap = top - rest_r  # sharding s saves at most `gap` of local work and costs f/n on every rank
        room_r = None
        shard_flops = self.shard_flops
        for s in self.state.local[r]:
            f_n = shard_flops[s]
            if f_n < gap:
                if room_r is None:
                    remaining = self.state.remaining
                    room_r = min(remaining[:r] + remaining[r + 1:])
                if room_r >= self.shards[s]:
                    t = clock.time(max(top - self.table.flops[s], rest_r), dist + f_n,
                                   self.volume + self.table.kv[s], num_dist + 1)
                    if t < threshold and (best is None or t < best[0]):
                        best = (t, "distribute", s, r, r, -1)
        if low != r:
            # the pair's new peak, without the other ranks: an exchange must lower the busier of the two
            exchange = self._best_exchange(r, low)
            if exchange is not None and exchange[0] < top * _SLACK:
                peak, s, partner = exchange
                t_new = clock.objective(self.comm, max(peak, rest_r if n > 2 else 0.0), dist, num_dist)
                if best is None or t_new <= best[0]:
                    best = (t_new, "move" if partner < 0 else "swap", s, r, low, partner)
        return best

    def _relocate(self, s: int, source: int, target: int) -> None:
        f = self.table.flops[s]
        self.state.relocate(s, source, target, self.table.lengths[s], f)
        self.local_load[source] -= f
        self.local_load[target] += f

    def apply(self, op: str, s: int, r: int, target: int, partner: int) -> None:
        if op == "move":
            self._relocate(s, r, target)
            return
        if op == "swap":  # free room on the target first, so no rank ever exceeds C mid-swap
            self._relocate(partner, target, r)
            self._relocate(s, r, target)
            return
        f = self.table.flops[s]
        self.state.shard_local(r, s, self.table.lengths[s], f)
        self.local_load[r] -= f
        self.dist += f / self.n
        self.volume += self.table.kv[s]
        self.num_dist += 1
        self.comm = self.clock.comm(self.volume)

    def run(self) -> float:
        """Local search until no candidate helps; returns the final modeled Time."""
        for _ in range(4 * (sum(len(r) for r in self.state.local) + 1)):
            step = self.best_step()
            if step is None:
                break
            self.apply(*step[1:])
        return self.current


def relocal_lpt(state: DacpState, table: SequenceTable, shard: int | None = None) -> DacpState | None:
    """The distributed set (plus `shard`), locals re-placed heaviest-first; None if one finds no room."""
    n = len(state.remaining)
    lengths, flops, shards_of = table.lengths, table.flops, table.shards(n)
    distributed = list(state.distributed) + ([] if shard is None else [shard])
    shards = sum(map(shards_of.__getitem__, distributed))
    bucket = (state.remaining[0] + sum(map(lengths.__getitem__, state.local[0]))
              + sum(map(shards_of.__getitem__, state.distributed)))
    if bucket - shards < 0:
        return None
    dist = sum(map(flops.__getitem__, distributed)) / n
    remaining, load = [bucket - shards] * n, [dist] * n
    local: list[list[int]] = [[] for _ in range(n)]
    heap = [(dist, j) for j in range(n)]  # (load, rank): the least loaded rank on top
    members = sorted(chain.from_iterable(state.local), key=table.weight_rank.__getitem__)  # heaviest first
    if shard is not None:
        members = [i for i in members if i != shard]
    for i in members:
        length = lengths[i]
        j = heap[0][1]
        if remaining[j] < length:  # rare: the least loaded rank is full, take the next that fits
            fits = [k for k in range(n) if remaining[k] >= length]
            if not fits:
                return None
            j = min(fits, key=lambda k: (load[k], k))
        remaining[j] -= length
        load[j] += flops[i]
        local[j].append(i)
        if j == heap[0][1]:
            heapq.heapreplace(heap, (load[j], j))
        else:
            heap = [(load[k], k) for k in range(n)]
            heapq.heapify(heap)
    return DacpState(remaining=remaining, load=load, local=local, distributed=distributed,
                     rollbacks=state.rollbacks)


def _heaviest_local(state: DacpState, table: SequenceTable) -> int | None:
    """The heaviest local sequence if it alone exceeds the ranks' fair share of local work, else None."""
    local = [i for rank in state.local for i in rank]
    if not local:
        return None
    flops = table.flops
    heaviest = min(local, key=table.weight_rank.__getitem__)  # most FLOPs, ties to the lowest index
    fair = sum(map(flops.__getitem__, local)) / len(state.local)
    return heaviest if flops[heaviest] > fair else None


def _chain_bound(state: DacpState, shard: int, table: SequenceTable, clock: Clock) -> float:
    """A lower bound of the modeled Time of every state the sharding chain reaches from `state` by
    sharding `shard` next: T_comm(V) + T_comp(Dist) (+ each sequence's sharded_sequence_s) of its
    distributed set.

    Along the chain the distributed set only grows (relocal_lpt adds a sequence, the local search only
    ever distributes more), T_comm and T_comp do not decrease with it, and Time >= T_comm(V) +
    T_comp(Dist) since the overlap term max(T_comm, T_comp(Local_j)) <= overlapped(...). A chain state is
    adopted only below best * (1 - 1e-9), so once this bound reaches `best` (it is computed with at most
    a few ulps of error, far below 1e-9) no later state can be adopted and the chain may stop.
    """
    distributed = [*state.distributed, shard]
    volume = sum(map(table.kv.__getitem__, distributed))
    return (clock.comm(volume) + clock.comp(sum(map(table.flops.__getitem__, distributed)) / clock.cp_size)
            + len(distributed) * clock.seq_s)


def refine(state: DacpState, lengths: Sequence[int], flops: Sequence[float], cost: CostModel, *,
           table: SequenceTable | None = None) -> None:
    """Improve a DacpState in place (see the module docstring); memory invariants are preserved.

    `table`: the batch's SequenceTable over these `lengths` and `flops` (built for the state's sequences
    when None).
    """
    n = len(state.remaining)
    if n <= 1:
        return
    if table is None:
        table = SequenceTable(lengths, flops, cost, [i for rank in state.local for i in rank]
                              + list(state.distributed))
    clock = cost.clock(n)
    # nothing beats perfectly spread compute with the ring hidden: stop early when we are there
    floor = clock.comp(sum(map(flops.__getitem__, chain.from_iterable(state.local))) / n
                       + sum(map(flops.__getitem__, state.distributed)) / n) * (1 + 1e-3)
    best, best_time = state, math.inf
    lpt = relocal_lpt(state, table)  # usually the better start, and cheaper to search
    if lpt is not None:
        best, best_time = lpt, _Refiner(lpt, table, clock).run()
    if best_time > floor:  # Algorithm 1's own placement, searched, as the other start
        state_time = _Refiner(state, table, clock).run()
        if state_time <= best_time * _SLACK:
            best, best_time = state, state_time
    candidate = best
    for _ in range(n):  # shard dominant local sequences one by one
        heaviest = None if best_time <= floor else _heaviest_local(candidate, table)
        if heaviest is not None and _chain_bound(candidate, heaviest, table, clock) >= best_time:
            break  # no state further down the chain can be adopted: stop (the result is the same)
        candidate = None if heaviest is None else relocal_lpt(candidate, table, shard=heaviest)
        if candidate is None:
            break
        # keep sharding along the chain even without a gain yet: two dominant sequences may both
        # need sharding before the ring traffic pays for itself
        candidate_time = _Refiner(candidate, table, clock).run()
        if candidate_time < best_time * _SLACK:
            best, best_time = candidate, candidate_time
    if best is not state:
        state.adopt(best)
