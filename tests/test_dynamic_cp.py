"""dynamic_cp, the Megatron-style baseline (scheduling/dynamic_cp.py): smallest fitting power-of-two degree,
S^2-balanced equal-work buckets, equal counts per DP rank, C respected."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling import POLICIES, CostModel, plan_step, sample_lengths, simulate
from scheduling.dynamic_cp import dynamic_cp, smallest_degrees
from scheduling.plans import shard_tokens

COST = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=16, num_layers=2)


@st.composite
def batches(draw):
    cp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    dp = draw(st.integers(1, 4))
    bucket = draw(st.integers(16, 3000))
    lengths = draw(st.lists(st.integers(1, bucket * cp), min_size=dp, max_size=40))
    return lengths, dp, cp, bucket


@settings(max_examples=60, deadline=None)
@given(batches())
def test_dynamic_cp_plans_are_valid(case):
    lengths, dp, cp, bucket = case
    step = plan_step("dynamic_cp", lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost=COST)
    step.check(lengths, bucket)  # every index once, C per CP rank
    assert step.dp_size == dp and step.cp_size == cp  # equal micro-batch counts: StepPlan checks them
    expected = smallest_degrees(lengths, cp, bucket, [d for d in (1, 2, 4, 8, 16) if d <= cp])
    for rank in step.micro_batches:
        for mb in rank:
            for i in mb.indices:
                assert mb.degree_of(i) == expected[i]  # the smallest power of two whose shard fits
    assert simulate(step, lengths, COST).bound_ratio_feasible >= 1 - 1e-9


def test_degree_is_the_smallest_fitting_power_of_two():
    assert smallest_degrees([10, 11, 25, 41, 80], 8, 10, (1, 2, 4, 8)) == [1, 2, 4, 8, 8]
    assert smallest_degrees([10, 11, 25], 4, 10, (1, 4)) == [1, 4, 4]  # cp_degrees restricts the set
    assert all(shard_tokens(s, d) <= 10 for s, d in zip([10, 11, 25], [1, 2, 4], strict=True))


def test_buckets_balance_quadratic_work():
    # eight equal short sequences and one long one at CP=1, C=400: three buckets (1200 tokens), the long
    # one alone, the short ones dealt to the least-worked bucket: four each
    lengths = [100] * 8 + [400]
    step = dynamic_cp(lengths, dp_size=1, cp_size=1, bucket_size=400)
    work = [sum(lengths[i] ** 2 for i in mb.indices) for mb in step.micro_batches[0]]
    assert sorted(work) == [40000, 40000, 160000]


def test_registered_and_planned_on_the_paper_distribution():
    assert "dynamic_cp" in POLICIES
    lengths = np.minimum(sample_lengths("chatqa2", 64, seed=1), 13000 * 16)
    step = plan_step("dynamic_cp", lengths, dp_size=2, cp_size=16, bucket_size=13000, cost=COST)
    step.check(lengths, 13000)
    assert any(mb.partial for rank in step.micro_batches for mb in rank)
