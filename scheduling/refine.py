"""Cost-model refinement of a DACP placement (our extension beyond the paper's Algorithm 1).

Algorithm 1 shards a sequence only under memory pressure and places local sequences shortest-first, so a
micro-batch whose longest sequence alone outweighs a rank's fair share ends up with one rank doing most
of the work (modeled CP imbalance ~2x on LMsysChat1M-like batches). The DACP objective itself
(minimize max_j Time_j, DESIGN.md section 3) is what we refine against:

    Time = max_j max(T_comm(V), T_comp(Local_j)) + T_comp(Dist)

Local search, starting from Algorithm 1's placement. On the rank r with the largest local load, try for
each of its local sequences s
    move:        s to the least-loaded rank (if it fits there)
    distribute:  s becomes sharded (if every other rank can take ceil(S/N) tokens)
and apply the candidate with the lowest modeled Time when it beats the current Time; stop otherwise.
Every step lowers Time strictly and memory stays within C, so Algorithm 1's guarantees survive, and the
loop is bounded (at most 2x the sequences of the micro-batch steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from scheduling.cost import CostModel
from scheduling.plans import shard_tokens

if TYPE_CHECKING:
    from scheduling.dacp import DacpState


class _Refiner:
    def __init__(self, state: DacpState, lengths: Sequence[int], flops: Sequence[float],
                 cost: CostModel) -> None:
        self.state, self.lengths, self.flops, self.cost = state, lengths, flops, cost
        self.n = len(state.remaining)
        self.local_load = [sum(flops[i] for i in rank) for rank in state.local]
        self.dist = sum(flops[i] for i in state.distributed) / self.n
        self.volume = sum(cost.kv_bytes(float(lengths[i])) for i in state.distributed)

    def time(self, max_local: float, dist: float, volume: float) -> float:
        c = self.cost
        return max(c.t_comm(volume, self.n), c.t_comp(max_local)) + c.t_comp(dist)

    def best_step(self) -> tuple[float, str, int, int, int] | None:
        """(new time, op, sequence, source rank, target rank) of the best candidate of the busiest rank."""
        loads, remaining, n = self.local_load, self.state.remaining, self.n
        r = loads.index(max(loads))
        low = loads.index(min(loads))
        # loads the candidates leave untouched: all but r (distribute), all but r and low (move)
        rest_r = max((loads[j] for j in range(n) if j != r), default=0.0)
        rest_r_low = max((loads[j] for j in range(n) if j not in (r, low)), default=0.0)
        room_r = min((remaining[j] for j in range(n) if j != r), default=0)
        comm = self.cost.t_comm(self.volume, n)
        dist_time = self.cost.t_comp(self.dist)
        best = None
        for s in self.state.local[r]:
            f, length = self.flops[s], int(self.lengths[s])
            if low != r and remaining[low] >= length:
                t = max(comm, self.cost.t_comp(max(loads[r] - f, loads[low] + f, rest_r_low))) + dist_time
                if best is None or t < best[0]:
                    best = (t, "move", s, r, low)
            if room_r >= shard_tokens(length, n):
                t = self.time(max(loads[r] - f, rest_r), self.dist + f / n,
                              self.volume + self.cost.kv_bytes(float(length)))
                if best is None or t < best[0]:
                    best = (t, "distribute", s, r, r)
        return best

    def apply(self, op: str, s: int, r: int, target: int) -> None:
        st, f, length = self.state, self.flops[s], int(self.lengths[s])
        st.local[r].remove(s)
        st.remaining[r] += length
        st.load[r] -= f
        self.local_load[r] -= f
        if op == "move":
            st.local[target].append(s)
            st.remaining[target] -= length
            st.load[target] += f
            self.local_load[target] += f
            return
        shard = shard_tokens(length, self.n)
        for j in range(self.n):
            st.remaining[j] -= shard
            st.load[j] += f / self.n
        st.distributed.append(s)
        self.dist += f / self.n
        self.volume += self.cost.kv_bytes(float(length))

    def run(self) -> None:
        current = self.time(max(self.local_load), self.dist, self.volume)
        for _ in range(2 * (sum(len(r) for r in self.state.local) + 1)):
            step = self.best_step()
            if step is None or step[0] >= current * (1 - 1e-9):
                return
            current = step[0]
            self.apply(*step[1:])


def refine(state: DacpState, lengths: Sequence[int], flops: Sequence[float], cost: CostModel) -> None:
    """Improve a DacpState in place (see the module docstring); memory invariants are preserved."""
    if len(state.remaining) > 1:
        _Refiner(state, lengths, flops, cost).run()
