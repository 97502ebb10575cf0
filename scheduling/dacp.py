"""DACP, the paper's Algorithm 1: which sequences of one micro-batch stay local, which are sharded.

State per CP rank j: RB[j] = remaining bucket (tokens), L[j] = load (FLOPs). Sequences are visited in
ascending length order (ties by index, so plans are deterministic):

    a. t = argmin(L);  RB[t] >= S        -> local on t          (balance compute first)
    b. t = argmax(RB); RB[t] >= S        -> local on t          (else the rank with most room)
    c. t = argmin(RB); RB[t] >= ceil(S/N) -> distributed:        every rank RB -= ceil(S/N), L += F(S)/N
    d. roll back on t = argmin(RB): its shortest local sequence s becomes distributed, then retry S.

The roll-back is the *consistent* one (docs/design.md §3), not the paper's printed one: rank t keeps
only a shard of s, every other rank is charged the new shard:

    RB[t] += S_s - ceil(S_s/N)        L[t] += F(S_s)/N - F(S_s)
    RB[j] -= ceil(S_s/N)   (j != t)   L[j] += F(S_s)/N

It is taken only if every other rank can hold that shard, so RB >= 0 holds after every step. Each
roll-back removes one local sequence, so the loop ends; if rank t has no local sequence (or its shortest
cannot be sharded) the roll-back gives up (dacp_assign returns None). The all-sharded plan may still fit
(the roll-back only ever shards rank t's shortest sequence): plan_dacp then returns it, and raises
SchedulingError only when even sum ceil(S/N) > C. GDS's splitter falls back the same way when it has a
cost model (scheduling.gds, step 4) and re-splits otherwise.

The state (RB, L, the placement) and its moves (place, distribute, relocate, shard_local) live in
`scheduling.dacp_state`, shared with the refinement.

After the loop, when a cost model is given, `scheduling.refine` improves the placement against the DACP
objective (move / shard sequences of the most loaded rank while the modeled time drops): an extension
beyond the paper, see that module. `refine=False` is the paper's Algorithm 1 alone.

`placement="roundrobin"` is the paper's Appendix B.2 ablation: skip step a (ignore compute, place each
sequence on the rank with the most remaining memory), roll-back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum

import numpy as np

from scheduling.cost import CostModel
from scheduling.dacp_state import DacpState, SequenceTable
from scheduling.plans import DacpPlan, SchedulingError, shard_tokens
from scheduling.refine import refine as refine_placement

__all__ = ["PLACEMENTS", "DacpState", "Placement", "all_sharded", "check_fits", "dacp_assign", "plan_dacp"]


class Placement(StrEnum):
    """How Algorithm 1 places a sequence: greedy (least-loaded rank first) or the App. B.2 ablation."""

    GREEDY = "greedy"
    ROUNDROBIN = "roundrobin"


PLACEMENTS = tuple(Placement)


def _roll_back(state: DacpState, rank: int, table: SequenceTable) -> bool:
    """Turn rank's shortest local sequence into a distributed one; False if that is impossible."""
    if not state.local[rank]:
        return False
    victim = min(state.local[rank], key=table.length_rank.__getitem__)  # shortest, ties to the lowest index
    shard = table.shards(state.cp_size)[victim]
    others = state.remaining[:rank] + state.remaining[rank + 1:]
    if others and min(others) < shard:  # some other rank cannot hold the new shard
        return False
    state.shard_local(rank, victim, table.lengths[victim], table.flops[victim])
    state.rollbacks += 1
    return True


def dacp_assign(order: Sequence[int], lengths: Sequence[int], flops: Sequence[float], *, cp_size: int,
                bucket_size: int, placement: Placement = Placement.GREEDY, cost: CostModel | None = None,
                on_step: Callable[[DacpState], None] | None = None,
                table: SequenceTable | None = None) -> DacpState | None:
    """Run Algorithm 1 on `order` (indices, ascending by length); None when the roll-back gives up.

    With `cost`, the result is then refined against the modeled micro-batch time. `table`: the batch's
    SequenceTable over these `lengths` and `flops` (GDS passes one for all its trial micro-batches;
    built for `order` when None).
    """
    if table is None:
        table = SequenceTable(lengths, flops, cost, order)
    state = DacpState.start(cp_size, bucket_size)
    remaining, load, local = state.remaining, state.load, state.local  # the state's own lists
    greedy = placement == Placement.GREEDY
    lens, shards = table.lengths, table.shards(cp_size)
    for index in order:
        length, shard = lens[index], shards[index]
        while True:
            # first minimum / maximum: deterministic ties
            t = load.index(min(load)) if greedy else -1
            if t < 0 or remaining[t] < length:
                t = remaining.index(max(remaining))
            if remaining[t] >= length:  # state.place, inline (the loop's common case)
                remaining[t] -= length
                load[t] += flops[index]
                local[t].append(index)
                break
            t = remaining.index(min(remaining))
            if remaining[t] >= shard:
                state.distribute(index, length, flops[index])
                break
            if not _roll_back(state, t, table):
                return None
            if on_step is not None:
                on_step(state)
        if on_step is not None:
            on_step(state)
    if cost is not None:
        refine_placement(state, lengths, flops, cost, table=table)
        if on_step is not None:
            on_step(state)
    return state


def check_fits(lengths: Sequence[int], cp_size: int, bucket_size: int, *, bounded: bool = True) -> None:
    """SchedulingError naming the knobs when a sequence can never fit one CP group (S > C*N); `bounded`
    False (a policy that cuts long sequences into chunks of C) checks only the knobs and empty sequences."""
    if cp_size < 1:
        raise SchedulingError(f"parallel.cp_size must be >= 1, got {cp_size}")
    if bucket_size < 1:
        raise SchedulingError(f"scheduling.bucket_size must be >= 1, got {bucket_size}")
    tokens = np.asarray(lengths).astype(np.int64).reshape(-1)  # astype truncates like int()
    longest = int(tokens.max()) if len(tokens) else 0
    if bounded and longest > bucket_size * cp_size:
        raise SchedulingError(
            f"a sequence of {longest} tokens exceeds scheduling.bucket_size * parallel.cp_size = "
            f"{bucket_size} * {cp_size} = {bucket_size * cp_size}: raise scheduling.bucket_size or "
            "parallel.cp_size, or cap data.max_length with data.too_long=truncate|drop"
        )
    if (tokens < 1).any():
        raise SchedulingError("every sequence needs >= 1 token (check the tokenizer / data source)")


def all_sharded(indices: Sequence[int], lengths: Sequence[int], cp_size: int,
                bucket_size: int) -> DacpPlan | None:
    """Every sequence sharded (static CP, also a valid DACP output); None if the shards overflow C."""
    if sum(shard_tokens(int(lengths[i]), cp_size) for i in indices) > bucket_size:
        return None
    return DacpPlan(local=((),) * cp_size, distributed=tuple(indices))


def plan_dacp(lengths: Sequence[int], *, cp_size: int, bucket_size: int, cost: CostModel,
              indices: Sequence[int] | None = None, placement: Placement = Placement.GREEDY,
              refine: bool = True,
              on_step: Callable[[DacpState], None] | None = None,
              labels: Sequence[int] | None = None) -> DacpPlan:
    """Plan one micro-batch (all of `lengths`, or the subset `indices`) over `cp_size` CP ranks.

    Algorithm 1 (+ the refinement unless refine=False); when its roll-back gives up, the all-sharded
    plan (every index distributed, in ascending length order) if sum ceil(S/N) <= C. SchedulingError
    only when neither fits, i.e. the micro-batch must be split.
    """
    if placement not in PLACEMENTS:
        raise SchedulingError(f"DACP placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    chosen = range(len(lengths)) if indices is None else indices
    check_fits([lengths[i] for i in chosen], cp_size, bucket_size)
    order = sorted(chosen, key=lambda i: (int(lengths[i]), i))
    flops = cost.sequence_flops(lengths, labels)
    state = dacp_assign(order, lengths, flops, cp_size=cp_size, bucket_size=bucket_size,
                        placement=placement, cost=cost if refine else None, on_step=on_step)
    if state is not None:
        return state.to_plan()
    # The roll-back only ever shards one rank's shortest local sequence, so it can give up although
    # sharding everything fits: that plan is a valid DACP output, and a plan must come back if one exists.
    plan = all_sharded(order, lengths, cp_size, bucket_size)
    if plan is None:
        total = sum(int(lengths[i]) for i in order)
        raise SchedulingError(
            f"DACP found no placement for a micro-batch of {len(order)} sequences / {total} tokens within "
            f"scheduling.bucket_size={bucket_size} per rank over parallel.cp_size={cp_size}, not even "
            "with every sequence sharded: split the micro-batch (plan_gds does) or raise "
            "scheduling.bucket_size"
        )
    return plan
