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
   since two dominant sequences may both have to be sharded before the ring traffic pays off).

Every step lowers Time strictly and keeps every rank within C tokens, so Algorithm 1's guarantees
(every index once, memory) survive; the local search is bounded (4 x (sequences + 1) steps).
Moves go through scheduling.dacp_state (relocate, shard_local, place: the same moves Algorithm 1
makes); the local search also caches Time's terms (local load per rank, shard load, ring volume).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from scheduling.cost import CostModel
from scheduling.dacp_state import DacpState
from scheduling.plans import shard_tokens

Step = tuple[float, str, int, int, int, int]
"""(new time, op, sequence, source rank, target rank, swap partner or -1)."""


class _Refiner:
    def __init__(self, state: DacpState, lengths: Sequence[int], flops: Sequence[float],
                 cost: CostModel) -> None:
        self.state, self.lengths, self.flops, self.cost = state, lengths, flops, cost
        self.n = len(state.remaining)
        # the objective's terms, kept in step with every move: the state's L mixes local and shard load
        self.local_load = [sum(flops[i] for i in rank) for rank in state.local]
        self.dist = sum(flops[i] for i in state.distributed) / self.n
        self.volume = sum(cost.kv_bytes(float(lengths[i])) for i in state.distributed)

    def time(self, max_local: float, dist: float, volume: float) -> float:
        c = self.cost
        return c.overlapped(c.t_comm(volume, self.n), c.t_comp(max_local)) + c.t_comp(dist)

    @property
    def current(self) -> float:
        return self.time(max(self.local_load), self.dist, self.volume)

    def _best_exchange(self, r: int, low: int, rest: float) -> tuple[float, int, int] | None:
        """Lowest max local load reachable by one move (t=-1) or swap (s <-> t) from r to low."""
        loads, remaining, lengths, flops = self.local_load, self.state.remaining, self.lengths, self.flops
        best = None
        for s in self.state.local[r]:
            f_s, len_s = flops[s], int(lengths[s])
            if remaining[low] >= len_s:
                peak = max(loads[r] - f_s, loads[low] + f_s, rest)
                if best is None or peak < best[0]:
                    best = (peak, s, -1)
            for t in self.state.local[low]:
                delta, grow = f_s - flops[t], len_s - int(lengths[t])
                if delta <= 0 or remaining[low] < grow or remaining[r] < -grow:
                    continue
                peak = max(loads[r] - delta, loads[low] + delta, rest)
                if best is None or peak < best[0]:
                    best = (peak, s, t)
        return best

    def best_step(self) -> Step | None:
        """The best candidate of the busiest rank (see the module docstring), or None."""
        loads, remaining, n = self.local_load, self.state.remaining, self.n
        r = loads.index(max(loads))
        low = loads.index(min(loads))
        # loads the candidates leave untouched: all but r (distribute), all but r and low (move, swap)
        rest_r = max((loads[j] for j in range(n) if j != r), default=0.0)
        rest_r_low = max((loads[j] for j in range(n) if j not in (r, low)), default=0.0)
        room_r = min((remaining[j] for j in range(n) if j != r), default=0)
        current = self.current
        best: Step | None = None
        gap = loads[r] - rest_r  # sharding s saves at most `gap` of local work and costs f/n on every rank
        for s in self.state.local[r]:
            f, length = self.flops[s], int(self.lengths[s])
            if f / n < gap and room_r >= shard_tokens(length, n):
                t = self.time(max(loads[r] - f, rest_r), self.dist + f / n,
                              self.volume + self.cost.kv_bytes(float(length)))
                if t < current * (1 - 1e-9) and (best is None or t < best[0]):
                    best = (t, "distribute", s, r, r, -1)
        if low != r:
            # the pair's new peak, without the other ranks: an exchange must lower the busier of the two
            exchange = self._best_exchange(r, low, 0.0)
            if exchange is not None and exchange[0] < loads[r] * (1 - 1e-9):
                peak, s, t = exchange
                t_new = self.time(max(peak, rest_r_low), self.dist, self.volume)
                if best is None or t_new <= best[0]:
                    best = (t_new, "move" if t < 0 else "swap", s, r, low, t)
        return best

    def _relocate(self, s: int, source: int, target: int) -> None:
        f = self.flops[s]
        self.state.relocate(s, source, target, int(self.lengths[s]), f)
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
        f, length = self.flops[s], int(self.lengths[s])
        self.state.shard_local(r, s, length, f)
        self.local_load[r] -= f
        self.dist += f / self.n
        self.volume += self.cost.kv_bytes(float(length))

    def run(self) -> float:
        """Local search until no candidate helps; returns the final modeled Time."""
        for _ in range(4 * (sum(len(r) for r in self.state.local) + 1)):
            step = self.best_step()
            if step is None:
                break
            self.apply(*step[1:])
        return self.current


def relocal_lpt(state: DacpState, lengths: Sequence[int], flops: Sequence[float],
                shard: int | None = None) -> DacpState | None:
    """The distributed set (plus `shard`), locals re-placed heaviest-first; None if one finds no room."""
    n = len(state.remaining)
    distributed = list(state.distributed) + ([] if shard is None else [shard])
    shards = sum(shard_tokens(int(lengths[i]), n) for i in distributed)
    bucket = state.remaining[0] + sum(int(lengths[i]) for i in state.local[0]) + sum(
        shard_tokens(int(lengths[i]), n) for i in state.distributed)
    dist = sum(flops[i] for i in distributed) / n
    out = DacpState(remaining=[bucket - shards] * n, load=[dist] * n, local=[[] for _ in range(n)],
                    distributed=distributed, rollbacks=state.rollbacks)
    if bucket - shards < 0:
        return None
    heap = [(dist, j) for j in range(n)]  # (load, rank): the least loaded rank on top
    local = (i for rank in state.local for i in rank if i != shard)
    for i in sorted(local, key=lambda i: (-flops[i], i)):
        length = int(lengths[i])
        j = heap[0][1]
        if out.remaining[j] < length:  # rare: the least loaded rank is full, take the next that fits
            fits = [k for k in range(n) if out.remaining[k] >= length]
            if not fits:
                return None
            j = min(fits, key=lambda k: (out.load[k], k))
        out.place(j, i, length, flops[i])
        if j == heap[0][1]:
            heapq.heapreplace(heap, (out.load[j], j))
        else:
            heap = [(out.load[k], k) for k in range(n)]
            heapq.heapify(heap)
    return out


def _heaviest_local(state: DacpState, flops: Sequence[float]) -> int | None:
    """The heaviest local sequence if it alone exceeds the ranks' fair share of local work, else None."""
    local = [i for rank in state.local for i in rank]
    if not local:
        return None
    heaviest = max(local, key=lambda i: (flops[i], -i))
    fair = sum(flops[i] for i in local) / len(state.local)
    return heaviest if flops[heaviest] > fair else None


def refine(state: DacpState, lengths: Sequence[int], flops: Sequence[float], cost: CostModel) -> None:
    """Improve a DacpState in place (see the module docstring); memory invariants are preserved."""
    if len(state.remaining) <= 1:
        return
    # nothing beats perfectly spread compute with the ring hidden: stop early when we are there
    floor = cost.t_comp(sum(flops[i] for rank in state.local for i in rank) / len(state.local)
                        + sum(flops[i] for i in state.distributed) / len(state.local)) * (1 + 1e-3)
    best, best_time = state, math.inf
    lpt = relocal_lpt(state, lengths, flops)  # usually the better start, and cheaper to search
    if lpt is not None:
        best, best_time = lpt, _Refiner(lpt, lengths, flops, cost).run()
    if best_time > floor:  # Algorithm 1's own placement, searched, as the other start
        state_time = _Refiner(state, lengths, flops, cost).run()
        if state_time <= best_time * (1 - 1e-9):
            best, best_time = state, state_time
    candidate = best
    for _ in range(len(state.remaining)):  # shard dominant local sequences one by one
        heaviest = None if best_time <= floor else _heaviest_local(candidate, flops)
        candidate = None if heaviest is None else relocal_lpt(candidate, lengths, flops, shard=heaviest)
        if candidate is None:
            break
        # keep sharding along the chain even without a gain yet: two dominant sequences may both
        # need sharding before the ring traffic pays for itself
        candidate_time = _Refiner(candidate, lengths, flops, cost).run()
        if candidate_time < best_time * (1 - 1e-9):
            best, best_time = candidate, candidate_time
    if best is not state:
        state.adopt(best)
