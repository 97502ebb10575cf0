"""Seeded synthetic sequence lengths matching the paper's datasets (docs/design.md §6).

Share of sequences below a length (K = 1024 tokens):

    dataset     <1K     <4K     <8K     <32K    <128K   longest
    wikipedia   87.88%  99.34%  99.92%  99.99%  100%    78K
    lmsys       87.12%  99.35%  99.87%  99.98%  99.99%  1643K
    chatqa2     21.92%  31.48%  40.43%  99.86%  100%    99K

Sampling is inverse-CDF on a uniform u, in two pieces:

    u < P(<1K):  the short body, a log-normal (median 300, sigma 1.05: the fit docs/design.md §6 reports
                 for the long-tail sets, which alone puts 88% below 1K) truncated to [16, 1K) by rejection;
    u >= P(<1K): log-linear interpolation of the quantile function between the table's knots, ending at
                 (1, longest). Between knots the density is log-uniform: a modeling choice, the table
                 pins nothing finer.

So every table point is reproduced up to sampling noise (about 0.1 percentage point at 100k samples) and
no length exceeds the dataset's longest.
"""

from __future__ import annotations

import math

import numpy as np

K = 1024
MIN_LENGTH = 16
BODY_MEDIAN = 300.0
BODY_SIGMA = 1.05
THRESHOLDS = (1 * K, 4 * K, 8 * K, 32 * K, 128 * K)

# name -> (shares below THRESHOLDS, longest length)
TABLE: dict[str, tuple[tuple[float, ...], int]] = {
    "wikipedia": ((0.8788, 0.9934, 0.9992, 0.9999, 1.0), 78 * K),
    "lmsys": ((0.8712, 0.9935, 0.9987, 0.9998, 0.9999), 1643 * K),
    "chatqa2": ((0.2192, 0.3148, 0.4043, 0.9986, 1.0), 99 * K),
}
DISTRIBUTIONS = tuple(TABLE)


def _tail_knots(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative share, log length) knots of the quantile function above 1K (1K itself excluded)."""
    shares, longest = TABLE[name]
    pairs = zip(shares[1:], THRESHOLDS[1:], strict=True)
    knots = [(p, float(t)) for p, t in pairs if t < longest and p < 1.0]
    knots.append((1.0, float(longest)))
    ps = np.array([p for p, _ in knots])
    logs = np.log(np.array([t for _, t in knots]))
    return ps, logs


def _body(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` log-normal lengths truncated to [MIN_LENGTH, 1K), by rejection (about 88% accepted)."""
    out: list[np.ndarray] = []
    have = 0
    while have < count:
        draw = rng.lognormal(math.log(BODY_MEDIAN), BODY_SIGMA, size=2 * (count - have) + 64)
        keep = draw[(draw >= MIN_LENGTH) & (draw < K)]
        out.append(keep)
        have += keep.size
    return np.concatenate(out)[:count] if out else np.empty(0)


def sample_lengths(name: str, n: int, seed: int = 0) -> np.ndarray:
    """`n` token lengths (int64) drawn from dataset `name` (one of DISTRIBUTIONS), seeded."""
    if name not in TABLE:
        raise ValueError(f"data.distribution={name!r} is not one of: {', '.join(DISTRIBUTIONS)}")
    if n < 0:
        raise ValueError(f"need n >= 0 lengths, got {n}")
    rng = np.random.default_rng(seed)
    u = rng.random(n)
    p_short = TABLE[name][0][0]
    short = u < p_short
    lengths = np.empty(n, dtype=np.float64)
    lengths[short] = _body(rng, int(short.sum()))
    ps, logs = _tail_knots(name)
    tail_ps = np.concatenate(([p_short], ps))
    tail_logs = np.concatenate(([math.log(K)], logs))
    lengths[~short] = np.exp(np.interp(u[~short], tail_ps, tail_logs))
    return np.clip(np.floor(lengths), MIN_LENGTH, TABLE[name][1]).astype(np.int64)
