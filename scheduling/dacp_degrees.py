"""DACP with per-sequence CP degrees (docs/design.md §13): each sequence of a micro-batch at degree 1 (local),
N (the whole CP group) or a power of two in between, on an aligned subgroup [g*d, (g+1)*d) of the group.

Per CP rank j the state holds RB[j] (tokens left of BucketSize C), its local FLOPs, its sharded FLOPs
(sum F/d of every sequence whose subgroup holds j), and its ring seconds comm_j (the sum of the rings of
the subgroups holding j: they share j's links). Its modeled time (scheduling.simulate, without b) is

    T_j = overlapped(comm_j, T_comp(Local_j)) + T_comp(Sharded_j)

and the micro-batch's is max_j T_j + b. A degree-d entry (d, g) costs ring(d, g, V) on each of its d ranks,
V being the K/V bytes of all its sequences (scheduling.cost.SubgroupClock: d-1 steps of V/(L*d) bytes,
intra- or inter-node links by whether the subgroup crosses a node).

Assignment (greedy, heaviest first by FLOPs, ties by index), for each sequence s of S tokens, F FLOPs:

    candidates   degree 1 on every rank j with RB[j] >= S; every degree d > 1 of `degrees` on every aligned
                 group g whose ranks all have RB >= ceil(S/d)
    score        (max(new micro-batch time, floor), added time summed over the touched ranks, the touched
                 ranks' new max), compared lexicographically (relative tolerance 1e-9 on the first two);
                 floor = T_comp(sum F / N) is the perfect-balance time of the micro-batch, so every
                 placement that keeps the micro-batch below it is free and the next criterion decides:
                 whole sequences beat sharded ones (sharding adds its ring and gains nothing below the
                 floor), and among ranks the least loaded wins (LPT)
    roll-back    no candidate fits: on the rank t with the least room, the lowest-degree, shortest sequence
                 that can move to the next degree up (its aligned parent subgroup holding t, whose other
                 ranks have room for the new, smaller shard) moves there, and s is retried. Degrees only
                 grow, so this ends; when no sequence on t can move, the assignment gives up (None).

Every step checks RB first, so the result holds at most C tokens per rank (ceil(S/d) per rank of a degree-d
sequence, DacpPlan.rank_tokens). The caller (scheduling.gds) keeps the two-level DACP plan of the same
micro-batch as a candidate and takes this one only when it models strictly faster, and skips this one when
the two-level plan already sits on the micro-batch's lower bound (`micro_batch_floor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scheduling.cost import SubgroupClock
from scheduling.dacp_state import SequenceTable
from scheduling.plans import SchedulingError
from scheduling.simulate import mixed_placement_times

__all__ = ["MixedPlacement", "assign_degrees", "is_two_level", "micro_batch_floor", "power_of_two_degrees",
           "resolve_cp_degrees"]

_TOL = 1e-9


def power_of_two_degrees(cp_size: int) -> tuple[int, ...]:
    """Every power of two that divides N: 1, 2, 4, ..., (`scheduling.cp_degrees: auto`)."""
    out, d = [], 1
    while d <= cp_size and cp_size % d == 0:
        out.append(d)
        d *= 2
    return tuple(out)


def resolve_cp_degrees(cp_degrees: str | Sequence[int] | None, cp_size: int) -> tuple[int, ...]:
    """The sorted degrees a planner may use: None -> (1, N) (the paper's two-level DACP), "auto" -> every
    power of two dividing N, a list -> itself, checked: powers of two dividing N, holding 1 and N.
    SchedulingError naming `scheduling.cp_degrees` otherwise."""
    if cp_degrees is None:
        return tuple(sorted({1, cp_size}))
    if isinstance(cp_degrees, str):
        if cp_degrees != "auto":
            raise SchedulingError(f"scheduling.cp_degrees={cp_degrees!r}: expected a list of CP degrees or "
                                  "'auto' (every power of two up to parallel.cp_size)")
        return power_of_two_degrees(cp_size)
    degrees = tuple(sorted({int(d) for d in cp_degrees}))
    bad = [d for d in degrees if d < 1 or d & (d - 1) or cp_size % d]
    if bad:
        raise SchedulingError(f"scheduling.cp_degrees={list(cp_degrees)}: {bad} are not powers of two "
                              f"dividing parallel.cp_size={cp_size}")
    if 1 not in degrees or cp_size not in degrees:
        raise SchedulingError(f"scheduling.cp_degrees={list(cp_degrees)} must contain 1 (local) and "
                              f"parallel.cp_size={cp_size} (the whole CP group)")
    return degrees


def is_two_level(degrees: Sequence[int], cp_size: int) -> bool:
    """True when the degrees allow nothing between local and the whole group (the paper's DACP)."""
    return all(d in (1, cp_size) for d in degrees)


class MixedPlacement:
    """One micro-batch with per-sequence degrees: local per rank, distributed (degree N), partial entries
    (degree, group, indices) in canonical order (degree descending, then group), and its modeled time."""

    __slots__ = ("distributed", "local", "partial", "time")

    def __init__(self, local: list[list[int]], distributed: list[int],
                 partial: list[tuple[int, int, list[int]]], time: float) -> None:
        self.local, self.distributed, self.partial, self.time = local, distributed, partial, time


def micro_batch_floor(members: Sequence[int], table: SequenceTable, clock: SubgroupClock,
                      degrees: Sequence[int]) -> float:
    """A lower bound of every placement of `members` at `degrees` (with b): max(T_comp(sum F / N),
    the heaviest sequence alone at its best degree) + b (scheduling.simulate's proof, per micro-batch)."""
    base, n = clock.base, clock.cp_size
    flops, kv = table.flops, table.kv
    heaviest = min(members, key=table.weight_rank.__getitem__)
    f, v = flops[heaviest], kv[heaviest]
    alone = min(base.comp(f) if d == 1 else clock.ring_floor(d, v) + base.comp(f / d) + clock.seq_s[d]
                for d in degrees)
    return max(base.comp(sum(map(flops.__getitem__, members)) / n), alone) + base.overhead


class _State:
    """The assignment's working state (module docstring); `where[i]` = (degree, group) of sequence i."""

    def __init__(self, n: int, bucket_size: int, table: SequenceTable, clock: SubgroupClock,
                 degrees: Sequence[int]) -> None:
        self.n, self.table, self.clock, self.degrees = n, table, clock, tuple(degrees)
        self.remaining = [bucket_size] * n
        self.local_load = [0.0] * n
        self.shard_load = [0.0] * n
        self.seq_load = [0.0] * n  # sharded_sequence_s of the sharded sequences on each rank
        self.comm = [0.0] * n
        self.times = [0.0] * n
        self.local: list[list[int]] = [[] for _ in range(n)]
        self.entries: dict[tuple[int, int], list[int]] = {}
        self.volume: dict[tuple[int, int], float] = {}
        self.ring: dict[tuple[int, int], float] = {}
        self.where: dict[int, tuple[int, int]] = {}
        base = clock.base
        self._comp, self._overlapped = base.comp, base.overlapped
        self._factor, self._denom, self._overlap = base.factor, base.denom, base.overlap

    def _retime(self, lo: int, hi: int) -> None:
        comp, overlapped = self._comp, self._overlapped
        for r in range(lo, hi):
            self.times[r] = (overlapped(self.comm[r], comp(self.local_load[r])) + comp(self.shard_load[r])
                             + self.seq_load[r])

    def add(self, i: int, degree: int, group: int) -> None:
        """Put sequence i at `degree` on `group` (degree 1: group is the rank)."""
        table = self.table
        self.where[i] = (degree, group)
        if degree == 1:
            self.remaining[group] -= table.lengths[i]
            self.local_load[group] += table.flops[i]
            self.local[group].append(i)
            self._retime(group, group + 1)
            return
        self._shard(i, degree, group, +1)

    def remove(self, i: int) -> None:
        degree, group = self.where.pop(i)
        table = self.table
        if degree == 1:
            self.remaining[group] += table.lengths[i]
            self.local_load[group] -= table.flops[i]
            self.local[group].remove(i)
            self._retime(group, group + 1)
            return
        self._shard(i, degree, group, -1)

    def _shard(self, i: int, degree: int, group: int, sign: int) -> None:
        table, key = self.table, (degree, group)
        members = self.entries.setdefault(key, [])
        if sign > 0:
            members.append(i)
        else:
            members.remove(i)
        volume = self.volume.get(key, 0.0) + sign * table.kv[i]
        if not members:
            volume = 0.0  # no float residue from adding and removing
        self.volume[key] = volume
        old = self.ring.get(key, 0.0)
        new = self.clock.ring(degree, group, volume)
        self.ring[key] = new
        shard, work = table.shards(degree)[i], table.flops[i] / degree
        sequence_s = self.clock.seq_s[degree]
        lo, hi = group * degree, (group + 1) * degree
        for r in range(lo, hi):
            self.remaining[r] -= sign * shard
            self.shard_load[r] += sign * work
            self.seq_load[r] += sign * sequence_s
            self.comm[r] += new - old
        self._retime(lo, hi)

    def best(self, i: int, floor_s: float, allowed: Sequence[int] | None = None) -> tuple[int, int] | None:
        """The best (degree, group) for sequence i (module docstring) among the `allowed` degrees (None:
        all of the state's), or None when nothing has room.

        The planner's inner loop: T_comp and overlapped are written out (x * factor / denominator, and
        c + l - overlap * min(c, l)); the keys only rank candidates, the chosen placement is timed with
        simulate's own function at the end."""
        table, n = self.table, self.n
        length, f, kv = table.lengths[i], table.flops[i], table.kv[i]
        remaining, times, comm = self.remaining, self.times, self.comm
        local_load, shard_load, seq_load = self.local_load, self.shard_load, self.seq_load
        factor, denom, overlap = self._factor, self._denom, self._overlap
        top = max(times)
        top_rank = times.index(top)
        second = max(times[:top_rank] + times[top_rank + 1:], default=0.0)
        best: tuple[int, int] | None = None
        best_peak = best_added = best_own = 0.0
        for degree in self.degrees if allowed is None else allowed:
            if degree == 1:
                for j in range(n):
                    if remaining[j] < length:
                        continue
                    c, loc = comm[j], (local_load[j] + f) * factor / denom
                    t = (c + loc - overlap * (c if c < loc else loc) + shard_load[j] * factor / denom
                         + seq_load[j])
                    peak = max(t, second if j == top_rank else top, floor_s)
                    added = t - times[j]
                    if best is None or _before(peak, added, t, best_peak, best_added, best_own):
                        best, best_peak, best_added, best_own = (1, j), peak, added, t
                continue
            shard = table.shards(degree)[i]
            work = f / degree
            sequence_s = self.clock.seq_s[degree]
            ring = self.clock.ring
            for group in range(n // degree):
                lo, hi = group * degree, (group + 1) * degree
                if min(remaining[lo:hi]) < shard:
                    continue
                key_e = (degree, group)
                delta = ring(degree, group, self.volume.get(key_e, 0.0) + kv) - self.ring.get(key_e, 0.0)
                peak_in = added = 0.0
                for r in range(lo, hi):
                    c, loc = comm[r] + delta, local_load[r] * factor / denom
                    t = (c + loc - overlap * (c if c < loc else loc) + (shard_load[r] + work) * factor / denom
                         + (seq_load[r] + sequence_s))
                    added += t - times[r]
                    if t > peak_in:
                        peak_in = t
                others = max(times[:lo] + times[hi:], default=0.0) if lo <= top_rank < hi else top
                peak = max(peak_in, others, floor_s)
                if best is None or _before(peak, added, peak_in, best_peak, best_added, best_own):
                    best, best_peak, best_added, best_own = (degree, group), peak, added, peak_in
        return best

    def promote(self) -> bool:
        """The generalized roll-back (module docstring); False when no sequence on the fullest rank moves."""
        t = self.remaining.index(min(self.remaining))
        table, degrees = self.table, self.degrees
        on_t = [(1, i) for i in self.local[t]]
        for degree in degrees:
            if 1 < degree < self.n:
                on_t += [(degree, i) for i in self.entries.get((degree, t // degree), ())]
        for degree, victim in sorted(on_t, key=lambda e: (e[0], table.length_rank[e[1]])):
            parent = next(d for d in degrees if d > degree)
            group, old_group = t // parent, t // degree
            shard = table.shards(parent)[victim]
            old = range(old_group * degree, (old_group + 1) * degree)
            new = range(group * parent, (group + 1) * parent)
            if all(self.remaining[r] >= shard for r in new if r not in old):
                self.remove(victim)
                self.add(victim, parent, group)
                return True
        return False

    def placement(self) -> MixedPlacement:
        """The state as a MixedPlacement, timed from scratch (simulate's own function, so equal floats)."""
        n = self.n
        distributed = list(self.entries.get((n, 0), ()))
        partial = [(d, g, list(members)) for (d, g), members in sorted(self.entries.items(),
                                                                        key=lambda e: (-e[0][0], e[0][1]))
                   if members and d < n]
        local = [list(rank) for rank in self.local]
        table = self.table
        times = mixed_placement_times(local, distributed, partial, table.flops, table.kv, self.clock)
        return MixedPlacement(local, distributed, partial, max(times))


def _before(peak: float, added: float, own: float, best_peak: float, best_added: float,
            best_own: float) -> bool:
    """(peak, added, own) < the best's, lexicographically, with a relative tolerance on the first two keys
    (float noise is no gain)."""
    tol = _TOL * max(peak, best_peak)
    if peak != best_peak and abs(peak - best_peak) > tol:
        return peak < best_peak
    tol = _TOL * max(abs(added), abs(best_added))
    if added != best_added and abs(added - best_added) > tol:
        return added < best_added
    return own < best_own


def assign_degrees(members: Sequence[int], table: SequenceTable, *, cp_size: int, bucket_size: int,
                   degrees: Sequence[int], clock: SubgroupClock,
                   fewest_ranks: bool = False) -> MixedPlacement | None:
    """Place one micro-batch's `members` at per-sequence degrees (module docstring); None if the
    roll-back gives up. `table` must carry K/V bytes (built with a cost model).

    `fewest_ranks`: each sequence is first offered only its smallest degree whose shard fits C (the
    subgroup and rank still chosen by the score), higher degrees only when no subgroup of that degree has
    room. The plain greedy decides one sequence at a time, so it can miss a placement that only pays off
    for several sequences together: two sequences of 2C on 4 ranks each model faster whole-group sharded
    while placed alone, yet together each on its own pair of ranks (the same compute per rank, a shorter
    ring). Callers try both and keep the faster."""
    state = _State(cp_size, bucket_size, table, clock, degrees)
    flops: Any = table.flops
    floor_s = clock.base.comp(sum(map(flops.__getitem__, members)) / cp_size)
    for i in sorted(members, key=table.weight_rank.__getitem__):
        allowed = _fewest_first(table.lengths[i], degrees, bucket_size) if fewest_ranks else None
        while True:
            where = state.best(i, floor_s, allowed[:1] if allowed else None)
            if where is None and allowed:
                where = state.best(i, floor_s, allowed)
            if where is not None:
                state.add(i, *where)
                break
            if not state.promote():
                return None
    return state.placement()


def _fewest_first(length: int, degrees: Sequence[int], bucket_size: int) -> list[int]:
    """The degrees at which a sequence of `length` tokens fits C, ascending (smallest first)."""
    return [d for d in sorted(degrees) if -(-length // d) <= bucket_size]
