"""Per-sequence CP degrees in the planner (issue 28, docs/design.md §13): valid plans, [1, N] is today's DACP,
all degrees never model slower, the mixed cost model, the lower bound, the payload, the config knob."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.config import ConfigError, load_config
from scheduling import (
    DISTRIBUTIONS,
    CostModel,
    DacpPlan,
    HardwareProfile,
    SchedulingError,
    StepPlan,
    SubgroupShards,
    plan_step,
    sample_lengths,
    simulate,
)
from scheduling.cost import SubgroupClock, subgroup_crosses_node
from scheduling.dacp_degrees import power_of_two_degrees, resolve_cp_degrees
from scheduling.gds import plan_gds_timed
from scheduling.payload import Cursor, Sample, build_rank_payloads
from scheduling.simulate import rank_times

# 7B-like dims on the H100 numbers, with a small node so CP groups of 8 and 16 cross nodes
PROFILE = HardwareProfile(gpus_per_node=4)
COST = CostModel.from_model_dims(hidden_size=3584, kv_hidden_size=512, num_layers=28, profile=PROFILE,
                                 num_params=7_000_000_000)
SMALL = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=16, num_layers=2)


@st.composite
def batches(draw):
    cp = draw(st.sampled_from([2, 4, 8, 16]))
    dp = draw(st.integers(1, 3))
    bucket = draw(st.integers(64, 4000))
    lengths = draw(st.lists(st.integers(1, bucket * cp), min_size=dp, max_size=24))
    return lengths, dp, cp, bucket


def _check_valid(step: StepPlan, lengths: list[int], bucket: int) -> None:
    step.check(lengths, bucket)  # every index once, every CP rank <= C tokens
    for rank in step.micro_batches:
        for mb in rank:
            for entry in mb.partial:  # DacpPlan validates alignment; the degree must divide N
                assert 1 < entry.degree < mb.cp_size and mb.cp_size % entry.degree == 0
                assert entry.group * entry.degree + entry.degree <= mb.cp_size


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(["skrull", "dynamic_cp"]))
def test_plans_with_all_degrees_are_valid(case, policy):
    lengths, dp, cp, bucket = case
    cost = COST if cp >= 8 else SMALL
    step = plan_step(policy, lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost=cost,
                     cp_degrees="auto")
    _check_valid(step, lengths, bucket)
    assert step.dp_size == dp and step.cp_size == cp
    assert plan_step(policy, lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost=cost,
                     cp_degrees="auto") == step  # deterministic
    est = simulate(step, lengths, cost)
    assert est.bound_ratio_feasible >= 1 - 1e-9 and est.bound_ratio >= 1 - 1e-9


@settings(max_examples=40, deadline=None)
@given(batches())
def test_all_degrees_never_model_slower_than_two_level(case):
    lengths, dp, cp, bucket = case
    cost = COST if cp >= 8 else SMALL
    shape = {"dp_size": dp, "cp_size": cp, "bucket_size": bucket, "cost": cost}
    two = simulate(plan_step("skrull", lengths, cp_degrees=[1, cp], **shape), lengths, cost).step_s
    mixed = plan_step("skrull", lengths, cp_degrees="auto", **shape)
    _check_valid(mixed, lengths, bucket)
    assert simulate(mixed, lengths, cost).step_s <= two * (1 + 1e-12)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("dp, cp, bucket", [(2, 4, 8000), (1, 8, 4000), (2, 16, 2000)])
def test_two_level_degrees_give_todays_dacp(distribution, dp, cp, bucket):
    lengths = np.minimum(sample_lengths(distribution, 48, seed=dp * cp), bucket * cp)
    shape = {"dp_size": dp, "cp_size": cp, "bucket_size": bucket, "cost": COST}
    today = plan_step("skrull", lengths, **shape)
    assert plan_step("skrull", lengths, cp_degrees=[1, cp], **shape) == today
    assert plan_step("skrull", lengths, cp_degrees=(cp, 1), **shape) == today
    assert all(not mb.partial for rank in today.micro_batches for mb in rank)


def test_chatqa2_like_batch_gains_from_intermediate_degrees():
    # CP=16 over 4-GPU nodes: the whole-group ring crosses nodes, degree-4 rings stay inside one
    lengths = np.minimum(sample_lengths("chatqa2", 64, seed=3), 13000 * 16)
    shape = {"dp_size": 2, "cp_size": 16, "bucket_size": 13000, "cost": COST}
    two = plan_step("skrull", lengths, cp_degrees=[1, 16], **shape)
    mixed = plan_step("skrull", lengths, cp_degrees="auto", **shape)
    assert any(mb.partial for rank in mixed.micro_batches for mb in rank)
    assert simulate(mixed, lengths, COST).step_s < simulate(two, lengths, COST).step_s
    plan, step_s = plan_gds_timed(lengths, cp_degrees="auto", **shape)
    assert step_s == pytest.approx(simulate(plan, lengths, COST).step_s, rel=1e-12)


def test_the_fewest_ranks_pass_finds_what_the_one_at_a_time_greedy_misses():
    # Two sequences of ~1.6 C on CP=4 with a slow link: placed alone, each models faster over all four
    # ranks (a quarter of the compute each), so the greedy shards both over the whole group; each on its
    # own pair of ranks does the same compute per rank over a 1-step ring instead of a 3-step one.
    from app.profiling.hardware import cost_model

    tiny = cost_model(load_config("tiny-cpu.yaml", ["parallel.num_workers=4", "parallel.cp_size=4"]))
    slow = dataclasses.replace(tiny, profile=dataclasses.replace(tiny.profile, intra_node_bandwidth=2e6))
    lengths, shape = [400, 400], {"dp_size": 1, "cp_size": 4, "bucket_size": 256, "cost": slow}
    two = plan_step("skrull", lengths, cp_degrees=[1, 4], **shape)
    mixed = plan_step("skrull", lengths, cp_degrees="auto", **shape)
    (mb,) = mixed.micro_batches[0]
    assert mb.distributed == () and [(e.degree, e.group) for e in mb.partial] == [(2, 0), (2, 1)]
    assert simulate(mixed, lengths, slow).step_s < simulate(two, lengths, slow).step_s


def test_mixed_cost_model_charges_each_ring_on_its_subgroup():
    profile = HardwareProfile(gpus_per_node=2, ring_overlap=1.0)
    cost = CostModel.from_model_dims(hidden_size=256, kv_hidden_size=64, num_layers=4, profile=profile)
    lengths = [4000, 3000, 2000, 1000, 500]
    flops = cost.sequence_flops(lengths)
    plan = DacpPlan(local=((4,), (), (), ()), distributed=(0,),
                    partial=(SubgroupShards(degree=2, group=0, indices=(1,)),
                             SubgroupShards(degree=2, group=1, indices=(2, 3))))
    times = rank_times(plan, lengths, flops, cost, world=4)
    kv = cost.kv_bytes
    p = profile

    def ring(volume: float, degree: int, inter: bool) -> float:
        bandwidth, latency = ((p.inter_node_bandwidth, p.inter_node_latency_s) if inter
                              else (p.intra_node_bandwidth, p.intra_node_latency_s))
        steps = p.comm_passes * cost.num_layers * (degree - 1)
        return steps * max(latency, volume / (cost.num_layers * degree) / bandwidth)

    whole = cost.t_comm(kv(4000), 4)  # 4 ranks over 2-GPU nodes: inter-node
    assert whole == pytest.approx(ring(kv(4000), 4, True))
    first, second = ring(kv(3000), 2, False), ring(kv(2000) + kv(1000), 2, False)  # pairs stay in a node
    b = cost.micro_batch_overhead_s(4)
    expect = [max(whole + first, cost.t_comp(flops[4])) + cost.t_comp(flops[0] / 4 + flops[1] / 2) + b,
              whole + first + cost.t_comp(flops[0] / 4 + flops[1] / 2) + b,
              whole + second + cost.t_comp(flops[0] / 4 + (flops[2] + flops[3]) / 2) + b,
              whole + second + cost.t_comp(flops[0] / 4 + (flops[2] + flops[3]) / 2) + b]
    assert times == pytest.approx(expect, rel=1e-12)
    # a two-level plan models exactly as before (the old code path)
    two = DacpPlan(local=((4,), (1,), (2,), (3,)), distributed=(0,))
    clock = SubgroupClock(cost, 4, 4)
    assert clock.ring(4, 0, kv(4000)) == cost.t_comm(kv(4000), 4)
    step = StepPlan(micro_batches=((two,),))
    assert simulate(step, lengths, cost).step_s == max(rank_times(two, lengths, flops, cost, world=4))


def test_subgroups_cross_nodes_by_their_world_ranks():
    # 6 GPUs per node, CP=4: CP group 1 holds world ranks 4..7, so its pair {4,5} is inside, {6,7} too,
    # but its whole group crosses; group 0's pairs are inside
    assert not subgroup_crosses_node(6, 4, 2, 0, 1) and not subgroup_crosses_node(6, 4, 2, 1, 1)
    assert subgroup_crosses_node(6, 8, 4, 1, 0)  # ranks 4..7 of an 8-group: across the 6-GPU node
    assert not subgroup_crosses_node(8, 16, 8, 1, 0) and subgroup_crosses_node(4, 16, 8, 0, 0)


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(0, 2**16))
def test_lower_bound_holds_for_random_mixed_plans(case, seed):
    lengths, dp, cp, bucket = case
    rng = np.random.default_rng(seed)
    degrees = power_of_two_degrees(cp)
    # a random valid-by-construction plan (memory ignored: the bound must hold for any placement)
    per_rank: list[list[DacpPlan]] = [[] for _ in range(dp)]
    for i in range(len(lengths)):
        d = int(rng.choice(degrees))
        g = int(rng.integers(cp // d))
        local = [[] for _ in range(cp)]
        if d == 1:
            local[g].append(i)
        entries = (SubgroupShards(degree=d, group=g, indices=(i,)),) if 1 < d < cp else ()
        per_rank[i % dp].append(DacpPlan(local=tuple(map(tuple, local)), distributed=(i,) if d == cp else (),
                                         partial=entries))
    count = max(len(r) for r in per_rank)
    empty = (DacpPlan.empty(cp),)
    step = StepPlan(micro_batches=tuple(tuple(r) + empty * (count - len(r)) for r in per_rank))
    for cost in (COST, SMALL, dataclasses.replace(COST, profile=HardwareProfile(ring_overlap=0.3))):
        est = simulate(step, lengths, cost, cp_degrees=degrees)
        assert est.feasible_bound_s <= est.step_s * (1 + 1e-12)
        assert est.bound_s <= est.feasible_bound_s


def test_payload_ships_partial_sequences_to_their_subgroup_only():
    plan = DacpPlan(local=((0,), (), (), ()), distributed=(1,),
                    partial=(SubgroupShards(degree=2, group=1, indices=(2,)),))
    samples = [Sample(sample_id=i, input_ids=np.arange(5 + i), labels=np.arange(5 + i)) for i in range(3)]
    payloads = build_rank_payloads(StepPlan(micro_batches=((plan,),)), samples, step=1, epoch=0,
                                   cursor=Cursor(epoch=0, rows=3), plan_ms=0.0)
    needed = {cp: sorted(payloads[0, cp].micro_batches[0].input_ids) for cp in range(4)}
    assert needed == {0: [0, 1], 1: [1], 2: [1, 2], 3: [1, 2]}


def test_resolve_cp_degrees():
    assert resolve_cp_degrees(None, 8) == (1, 8)
    assert resolve_cp_degrees("auto", 8) == (1, 2, 4, 8)
    assert resolve_cp_degrees("auto", 1) == (1,) and resolve_cp_degrees(None, 1) == (1,)
    assert resolve_cp_degrees([8, 1, 2], 8) == (1, 2, 8)
    for bad, message in (([1, 3, 8], "powers of two"), ([1, 16, 8], "powers of two"), ([2, 8], "contain 1"),
                         ([1, 4], "contain 1"), ("all", "auto")):
        with pytest.raises(SchedulingError, match="scheduling.cp_degrees"):
            resolve_cp_degrees(bad, 8)
        assert message


@pytest.mark.parametrize("value, message", [
    ("[1, 2]", "must contain 1"), ("[2, 4]", "must contain 1"), ("[1, 3, 4]", "power of two"),
    ("[1, 4, 8]", "dividing parallel.cp_size=4"), ("fast", "'auto'"), ("[0, 1, 4]", "power of two"),
])
def test_config_rejects_bad_cp_degrees(value, message):
    with pytest.raises(ConfigError, match=r"scheduling\.cp_degrees") as err:
        load_config(None, ["parallel.num_workers=4", "parallel.cp_size=4", f"scheduling.cp_degrees={value}"])
    assert message in str(err.value)


def test_config_cp_degrees_default_and_list():
    base = ["parallel.num_workers=8", "parallel.cp_size=8"]
    assert load_config(None, base).cp_degrees == (1, 2, 4, 8)
    config = load_config(None, [*base, "scheduling.cp_degrees=[1, 8]"])
    assert config.cp_degrees == (1, 8) and config.scheduling.cp_degrees == (1, 8)
    assert load_config(None, [*base, "scheduling.cp_degrees=auto"]).cp_degrees == (1, 2, 4, 8)
