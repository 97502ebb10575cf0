"""balanced_packed: LPT over modeled FLOPs across DP ranks, best-fit-decreasing micro-batches, all sharded.

The policy-wide invariants (every sample once, C respected, equal counts, deterministic, bounds) are
tests/test_scheduling_policies.py's, which draws every registered policy.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling import CostModel, plan_step, sample_lengths, simulate
from scheduling.balanced_packed import best_fit_decreasing, lpt_partition

QWEN = CostModel.from_model_dims(hidden_size=896, kv_hidden_size=128, num_layers=24, num_params=494032768)


def test_lpt_places_largest_first_on_the_lightest_rank() -> None:
    # 7 -> rank 0; 5 -> rank 1; 4 -> rank 1 (5 < 7); 3 (index 0) -> rank 0 (7 < 9); 3 -> rank 1 (9 < 10)
    parts = lpt_partition([3, 7, 4, 5, 3], 2)
    loads = [sum([3, 7, 4, 5, 3][i] for i in part) for part in parts]
    assert sorted(i for part in parts for i in part) == [0, 1, 2, 3, 4]
    assert parts == [[1, 0], [3, 2, 4]] and loads == [10, 12]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=60), st.integers(100, 200))
def test_best_fit_decreasing_fits_and_leaves_no_two_bins_that_would_fit_in_one(sizes, capacity) -> None:
    bins = best_fit_decreasing(range(len(sizes)), sizes, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= capacity for b in bins)
    # Any-fit property: a bin opens only when the item fits no open bin, so no two bins together fit in
    # one (at most one bin is at most half full). In-order packing (static_cp_packed's) lacks it.
    loads = sorted(sum(sizes[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity
    # a lower bound any packing respects
    assert len(bins) >= -(-sum(sizes) // capacity)


def test_balanced_packed_balances_dp_ranks_better_than_data_order_on_paper_batches() -> None:
    for dist in ("lmsys", "chatqa2"):
        imbalance = {"balanced_packed": [], "static_cp_packed": []}
        for seed in range(3):
            lengths = np.minimum(sample_lengths(dist, 256, seed), 26000 * 8)
            for policy in imbalance:
                step = plan_step(policy, lengths, dp_size=4, cp_size=8, bucket_size=26000, cost=QWEN)
                imbalance[policy].append(simulate(step, lengths, QWEN).dp_imbalance)
        balanced, packed = (np.mean(imbalance[p]) for p in ("balanced_packed", "static_cp_packed"))
        assert balanced < packed, (dist, imbalance)
        assert max(imbalance["balanced_packed"]) < 1.05, imbalance
