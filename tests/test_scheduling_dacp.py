"""DACP (Algorithm 1 + consistent roll-back + refinement): coverage, memory, invariants after every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling import CostModel, DacpPlan, SchedulingError, plan_dacp, sample_lengths, shard_tokens
from scheduling.dacp import dacp_assign
from scheduling.dacp_state import DacpState

COST = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=16, num_layers=2)


def _check_state(state: DacpState, lengths: list[int], bucket: int) -> None:
    """RB and L must equal what the current placement implies, and RB >= 0 (memory) on every rank."""
    n = len(state.remaining)
    shards = sum(shard_tokens(lengths[i], n) for i in state.distributed)
    dist = sum(COST.flops(lengths[i]) for i in state.distributed) / n
    for j in range(n):
        used = sum(lengths[i] for i in state.local[j]) + shards
        assert state.remaining[j] == bucket - used >= 0
        load = sum(COST.flops(lengths[i]) for i in state.local[j]) + dist
        assert state.load[j] == pytest.approx(load, rel=1e-9)  # float sums in a different order


@st.composite
def micro_batches(draw):
    cp = draw(st.integers(1, 6))
    bucket = draw(st.integers(8, 200))
    lengths = draw(st.lists(st.integers(1, bucket * cp), min_size=1, max_size=24))
    return lengths, cp, bucket


@settings(max_examples=150, deadline=None)
@given(micro_batches(), st.sampled_from(["greedy", "roundrobin"]), st.booleans())
def test_dacp_plan_or_clear_error(case, placement, refine):
    lengths, cp, bucket = case
    try:
        plan = plan_dacp(lengths, cp_size=cp, bucket_size=bucket, cost=COST, placement=placement,
                         refine=refine, on_step=lambda s: _check_state(s, lengths, bucket))
    except SchedulingError as err:
        assert "scheduling.bucket_size" in str(err)
        assert sum(shard_tokens(s, cp) for s in lengths) > bucket  # else the all-sharded plan is returned
        return
    assert sorted(plan.indices) == list(range(len(lengths)))
    assert plan.cp_size == cp
    assert max(plan.rank_tokens(lengths)) <= bucket


def test_fitting_sequences_never_fail_alone():
    for length in (1, 99, 100, 101, 399, 400):
        plan = plan_dacp([length], cp_size=4, bucket_size=100, cost=COST)
        assert plan.indices == (0,)
        assert (plan.distributed == (0,)) == (length > 100)


def test_rollback_is_exercised_and_consistent():
    # C=10, N=2: 5 goes local on rank 0 (RB 5, 10); 13 needs a 7-token shard: no rank has 13 free and
    # rank 0 has only 5 -> roll back 5 into shards of 3 (RB 7, 7) -> 13 is distributed (RB 0, 0).
    seen: list[int] = []
    lengths = [5, 13]

    def observe(state: DacpState) -> None:
        _check_state(state, lengths, 10)
        seen.append(state.rollbacks)

    plan = plan_dacp(lengths, cp_size=2, bucket_size=10, cost=COST, refine=False, on_step=observe)
    assert max(seen) == 1
    assert plan == DacpPlan(local=((), ()), distributed=(0, 1))


def test_too_long_names_the_knobs():
    with pytest.raises(SchedulingError, match="scheduling.bucket_size.*parallel.cp_size.*data.max_length"):
        plan_dacp([5, 81], cp_size=8, bucket_size=10, cost=COST)


def test_refinement_shards_a_dominant_sequence():
    # One 3000-token sequence among short ones: Algorithm 1 keeps it local (memory allows), which
    # leaves one rank with most of the FLOPs; the refinement must shard it (modeled time drops).
    cost = CostModel.from_model_dims(hidden_size=896, kv_hidden_size=128, num_layers=24)
    lengths = [200] * 30 + [3000]
    raw = plan_dacp(lengths, cp_size=4, bucket_size=26000, cost=cost, refine=False)
    refined = plan_dacp(lengths, cp_size=4, bucket_size=26000, cost=cost)
    assert 30 not in raw.distributed and refined.distributed == (30,)


QWEN = CostModel.from_model_dims(hidden_size=896, kv_hidden_size=128, num_layers=24)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(2000, 12000), st.lists(st.integers(1, 6000), min_size=4, max_size=40))
def test_refinement_keeps_invariants_and_never_models_slower(cp, bucket, raw):
    # Real-model dims so that moves, swaps, LPT re-placement and sharding chains all trigger.
    from scheduling.simulate import rank_times

    lengths = [min(s, bucket * cp) for s in raw]
    seen: list[int] = []

    def observe(state: DacpState) -> None:
        seen.append(state.rollbacks)
        n = len(state.remaining)
        shards = sum(shard_tokens(lengths[i], n) for i in state.distributed)
        for j in range(n):
            assert state.remaining[j] == bucket - sum(lengths[i] for i in state.local[j]) - shards >= 0

    try:
        raw_plan = plan_dacp(lengths, cp_size=cp, bucket_size=bucket, cost=QWEN, refine=False)
    except SchedulingError:
        return  # Algorithm 1 alone gave up: nothing to refine
    plan = plan_dacp(lengths, cp_size=cp, bucket_size=bucket, cost=QWEN, on_step=observe)
    assert seen  # the invariants were checked (Algorithm 1 observes once per sequence at least)
    assert sorted(plan.indices) == list(range(len(lengths)))
    assert max(plan.rank_tokens(lengths)) <= bucket
    flops = [QWEN.flops(s) for s in lengths]
    assert max(rank_times(plan, lengths, flops, QWEN)) <= max(rank_times(raw_plan, lengths, flops, QWEN)) * (
        1 + 1e-12)


def test_refinement_shards_two_dominant_sequences_together():
    # Two ~3.5K sequences each above a rank's fair share: sharding only one does not pay (the other
    # still dominates), so the refinement must follow the sharding chain past a non-improving step.
    lengths = [3500, 3400] + [300] * 60
    plan = plan_dacp(lengths, cp_size=8, bucket_size=26000, cost=QWEN)
    assert set(plan.distributed) >= {0, 1}


def _fits_all_sharded(lengths: list[int], cp: int, bucket: int) -> bool:
    return sum(shard_tokens(s, cp) for s in lengths) <= bucket


def test_all_sharded_when_the_roll_back_gives_up():
    # An LMSYS-like mix on CP=8, C=2000: Algorithm 1 keeps the first nine local (rank 0 holds 67 + 1834).
    # For the 3105-token sequence (shard 389) it rolls back 67, then must roll back 1834 from rank 0, whose
    # 230-token shard no longer fits on rank 7 (196 left): the roll-back gives up. Sharding all ten costs
    # 1,268 tokens per rank, which fits. plan_dacp used to raise here.
    lengths = sample_lengths("lmsys", 10, 174).tolist()
    assert lengths == [1795, 406, 1834, 259, 67, 458, 3105, 1353, 183, 635]
    assert sum(shard_tokens(s, 8) for s in lengths) == 1268
    order = sorted(range(10), key=lambda i: (lengths[i], i))
    flops = [QWEN.flops(s) for s in lengths]
    assert dacp_assign(order, lengths, flops, cp_size=8, bucket_size=2000) is None
    for refine in (True, False):
        plan = plan_dacp(lengths, cp_size=8, bucket_size=2000, cost=QWEN, refine=refine)
        assert plan == DacpPlan(local=((),) * 8, distributed=tuple(order))
        assert max(plan.rank_tokens(lengths)) <= 2000


@st.composite
def fitting_micro_batches(draw):
    """Random lengths (mostly <= C, some up to C*N), CP 1..8 and C; a length is kept while the
    all-sharded placement still fits (the first always does), so batches are near full and Algorithm
    1's roll-back gives up on some of them (a few percent; the test above pins one such batch)."""
    cp = draw(st.integers(1, 8))
    bucket = draw(st.integers(1, 3000))
    short, long = st.integers(1, bucket), st.integers(1, bucket * cp)
    raw = draw(st.lists(st.one_of(short, short, short, long), min_size=4, max_size=40))
    lengths: list[int] = []
    for s in raw:
        if _fits_all_sharded([*lengths, s], cp, bucket):
            lengths.append(s)
    return lengths, cp, bucket


@settings(max_examples=200, deadline=None)
@given(fitting_micro_batches(), st.sampled_from(["greedy", "roundrobin"]), st.booleans(),
       st.sampled_from([COST, QWEN]))
def test_plan_dacp_never_fails_when_all_sharded_fits(case, placement, refine, cost):
    lengths, cp, bucket = case
    assert _fits_all_sharded(lengths, cp, bucket)  # by construction
    plan = plan_dacp(lengths, cp_size=cp, bucket_size=bucket, cost=cost, placement=placement, refine=refine)
    assert sorted(plan.indices) == list(range(len(lengths)))  # every index exactly once
    assert plan.cp_size == cp
    assert max(plan.rank_tokens(lengths)) <= bucket
