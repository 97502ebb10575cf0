"""Synthetic length distributions reproduce docs/design.md §6 (1 percentage point at 100k samples)."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling import DISTRIBUTIONS, sample_lengths
from scheduling.distributions import TABLE, THRESHOLDS


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_cdf_and_longest(name):
    lengths = sample_lengths(name, 100_000, seed=0)
    shares, longest = TABLE[name]
    for threshold, share in zip(THRESHOLDS, shares, strict=True):
        # the tolerance; sampling noise alone is ~0.1 pp at 100k samples
        assert abs((lengths < threshold).mean() - share) <= 0.01, (name, threshold)
    assert lengths.max() <= longest
    assert lengths.max() >= longest // 2  # the tail reaches toward the dataset's longest sequence
    assert lengths.dtype == np.int64 and lengths.min() >= 1


def test_seeded():
    assert np.array_equal(sample_lengths("lmsys", 1000, 7), sample_lengths("lmsys", 1000, 7))
    assert not np.array_equal(sample_lengths("lmsys", 1000, 7), sample_lengths("lmsys", 1000, 8))


def test_unknown_distribution_names_the_knob():
    with pytest.raises(ValueError, match="data.distribution"):
        sample_lengths("pile", 10, 0)
