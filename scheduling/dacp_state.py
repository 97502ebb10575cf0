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

`SequenceTable` holds what the planners read per sequence many times over one batch (tokens as ints,
FLOPs, K/V bytes, ceil(S/N), F/N, and the two orders Algorithm 1 and the refinement sort by), computed
once: GDS plans hundreds of trial micro-batches of the same batch (docs/design.md §3-4).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduling.cost import CostModel
from scheduling.plans import DacpPlan, shard_tokens


class SequenceTable:
    """Per-sequence numbers of one batch, indexed by sequence like `lengths` (module docstring).

    lengths[i]       int(S_i)
    flops[i]         F_i, the caller's list (whatever label counts it was computed with)
    kv[i]            cost.kv_bytes(float(S_i)), the ring volume of sharding i (empty without a cost model)
    length_rank[i]   position of i in the order (S_i, i): Algorithm 1's visiting order and roll-back victim
    weight_order     the indices in the order (-F_i, i): heaviest first (LPT, the dominant sequence)
    weight_rank[i]   position of i in weight_order
    shards(N)[i]     ceil(S_i / N);  shard_flops(N)[i]  F_i / N

    Over a whole batch (`indices` None) the columns are lists built with numpy (the same float operations
    elementwise, so the same bits as the scalar formulas); over `indices` only (one micro-batch planned
    on its own) they are dicts of those indices, so a caller planning small groups of a large batch pays
    for its group only.
    """

    __slots__ = ("flops", "kv", "length_rank", "lengths", "weight_order", "weight_rank", "_per_cp")

    def __init__(self, lengths: Sequence[int], flops: Sequence[float], cost: CostModel | None,
                 indices: Iterable[int] | None = None) -> None:
        self.flops = flops
        self._per_cp: dict[int, tuple[Any, Any]] = {}
        if indices is None:
            lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
            self.lengths: Any = lens.tolist()
            self.kv: Any = [] if cost is None else cost.kv_bytes(lens.astype(np.float64)).tolist()
            number = np.arange(len(lens))
            self.length_rank: Any = self._ranks(np.lexsort((number, lens)))
            weights = np.asarray(flops, dtype=np.float64).reshape(-1)
            heaviest_first = np.lexsort((number, -weights))
            self.weight_order: list[int] = heaviest_first.tolist()
            self.weight_rank: Any = self._ranks(heaviest_first)
            return
        members = list(indices)
        self.lengths = {i: int(lengths[i]) for i in members}
        self.kv = {} if cost is None else {i: cost.kv_bytes(float(self.lengths[i])) for i in members}
        by_length = sorted(members, key=lambda i: (self.lengths[i], i))
        self.length_rank = {i: k for k, i in enumerate(by_length)}
        self.weight_order = sorted(members, key=lambda i: (-flops[i], i))
        self.weight_rank = {i: k for k, i in enumerate(self.weight_order)}

    @staticmethod
    def _ranks(order: np.ndarray) -> list[int]:
        ranks = np.empty(len(order), dtype=np.int64)
        ranks[order] = np.arange(len(order))
        return ranks.tolist()

    def _columns(self, cp_size: int) -> tuple[Any, Any]:
        columns = self._per_cp.get(cp_size)
        if columns is None:
            if isinstance(self.lengths, dict):
                columns = ({i: shard_tokens(s, cp_size) for i, s in self.lengths.items()},
                           {i: self.flops[i] / cp_size for i in self.lengths})
            else:
                lens = np.asarray(self.lengths, dtype=np.int64)
                columns = ((-(-lens // cp_size)).tolist(),
                           (np.asarray(self.flops, dtype=np.float64) / cp_size).tolist())
            self._per_cp[cp_size] = columns
        return columns

    def shards(self, cp_size: int) -> Any:
        """ceil(S_i / N) per sequence (tokens every rank holds of i sharded over N ranks)."""
        return self._columns(cp_size)[0]

    def shard_flops(self, cp_size: int) -> Any:
        """F_i / N per sequence (FLOPs every rank runs of i sharded over N ranks)."""
        return self._columns(cp_size)[1]


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
        n = len(self.remaining)
        shard, shard_flops = shard_tokens(length, n), flops / n
        # in place (callers hold these lists), the same arithmetic as a loop of -= / +=
        self.remaining[:] = [room - shard for room in self.remaining]
        self.load[:] = [load + shard_flops for load in self.load]
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
