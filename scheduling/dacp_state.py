"""DACP's working state for one micro-batch and the moves that change it (Algorithm 1 and the refinement).

Per CP rank j of N: RB[j] = remaining bucket (tokens), L[j] = load (forward FLOPs), plus the placement
(local sequences per rank, the distributed list). A move keeps RB and L equal to what the placement
implies (a local sequence of S tokens / F FLOPs costs its rank S and F, a distributed one costs every
rank ceil(S/N) and F/N):

    place(j, s)          local on j:          RB[j] -= S            L[j] += F
    distribute(s)        sharded, all ranks:  RB[*] -= ceil(S/N)    L[*] += F/N
    relocate(s, a, b)    local a -> local b:  RB[a] += S, RB[b] -= S, L[a] -= F, L[b] += F
    shard_local(j, s)    local j -> sharded:  undo place(j, s), then distribute(s)
                         (Algorithm 1's roll-back, the refinement's "distribute" step)

Moves do not check capacity: the callers (scheduling.dacp, scheduling.refine) test RB first, which is
where the algorithms differ. Both modules import this one, so neither imports the other's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.plans import DacpPlan, shard_tokens


@dataclass(slots=True)
class DacpState:
    """Mutable working state of DACP (exposed to `on_step` observers, e.g. invariant tests)."""

    remaining: list[int]
    """RB[j]: tokens rank j can still take."""
    load: list[float]
    """L[j]: forward FLOPs assigned to rank j."""
    local: list[list[int]]
    distributed: list[int]
    rollbacks: int = 0

    @classmethod
    def start(cls, cp_size: int, bucket_size: int) -> DacpState:
        """Nothing placed yet: every rank has the whole bucket and no load."""
        return cls(remaining=[bucket_size] * cp_size, load=[0.0] * cp_size,
                   local=[[] for _ in range(cp_size)], distributed=[])

    @property
    def cp_size(self) -> int:
        return len(self.remaining)

    def place(self, rank: int, index: int, length: int, flops: float) -> None:
        """Keep sequence `index` whole on `rank`."""
        self.remaining[rank] -= length
        self.load[rank] += flops
        self.local[rank].append(index)

    def distribute(self, index: int, length: int, flops: float) -> None:
        """Shard sequence `index` over every rank (ceil(S/N) tokens and F/N FLOPs each)."""
        shard, shard_flops = shard_tokens(length, self.cp_size), flops / self.cp_size
        for j in range(self.cp_size):
            self.remaining[j] -= shard
            self.load[j] += shard_flops
        self.distributed.append(index)

    def relocate(self, index: int, source: int, target: int, length: int, flops: float) -> None:
        """Move local sequence `index` from `source` to `target`."""
        self._unplace(source, index, length, flops)
        self.place(target, index, length, flops)

    def shard_local(self, rank: int, index: int, length: int, flops: float) -> None:
        """Turn local sequence `index` of `rank` into a distributed one (undo the placement, shard it)."""
        self._unplace(rank, index, length, flops)
        self.distribute(index, length, flops)

    def adopt(self, other: DacpState) -> None:
        """Take `other`'s placement in place (observers holding this object see the result)."""
        self.remaining[:], self.load[:] = other.remaining, other.load
        self.local[:], self.distributed[:] = other.local, other.distributed

    def to_plan(self) -> DacpPlan:
        return DacpPlan(local=tuple(tuple(r) for r in self.local), distributed=tuple(self.distributed))

    def _unplace(self, rank: int, index: int, length: int, flops: float) -> None:
        self.local[rank].remove(index)
        self.remaining[rank] += length
        self.load[rank] -= flops
