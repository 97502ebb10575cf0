"""The held-out eval split (data.eval_fraction): which sample ids never train.

A sample is held out when a 64-bit hash of (data.seed, sample id) maps below the fraction:

    key  = splitmix64(seed)                     (one 64-bit key per seed)
    u    = splitmix64(key XOR id) / 2**64       (uniform in [0, 1), independent per id)
    eval = u < eval_fraction

The sample id is the row's position in the run's deterministic tokenized stream (scheduling/actor.py), so
the split depends on (seed, id, fraction) only: not on batching, the planner's cursor, the worker count or
the epoch. A resumed run or one on another DP size skips exactly the same ids, and a training epoch is the
stream minus the held-out ids. splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) is a bijection on 64 bits with full avalanche, so consecutive ids give unrelated
draws and an epoch holds out ~fraction of its rows (binomial spread).

Pure numpy, no Ray: the planner actor and the driver's row counts both call `held_out`.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function of x + golden ratio, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def held_out(sample_ids: np.ndarray | list[int], *, seed: int, fraction: float) -> np.ndarray:
    """Boolean mask over `sample_ids` (non-negative ints): True where the sample belongs to the eval set.

    fraction 0 holds out nothing; ValueError outside [0, 1) (the config already checks
    data.eval_fraction, this guards other callers).
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"eval fraction must be in [0, 1), got {fraction}")
    ids = np.asarray(sample_ids, dtype=np.int64)
    if fraction == 0 or ids.size == 0:
        return np.zeros(ids.shape, dtype=bool)
    if (ids < 0).any():
        raise ValueError("sample ids must be >= 0")
    key = splitmix64(np.asarray([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    draws = splitmix64(ids.astype(np.uint64) ^ key) >> np.uint64(11)  # 53 bits: exact in float64
    return draws.astype(np.float64) * 2.0 ** -53 < fraction


def is_held_out(sample_id: int, *, seed: int, fraction: float) -> bool:
    """`held_out` for one id (the planner's row loop)."""
    return bool(held_out([sample_id], seed=seed, fraction=fraction)[0])
