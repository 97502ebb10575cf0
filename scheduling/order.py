"""The order in which the planner visits one epoch's rows (data.shuffle).

    shuffle on:   order(epoch) = Generator(PCG64(SeedSequence([seed, epoch]))).permutation(num_rows)
    shuffle off:  order(epoch) = 0, 1, ..., num_rows - 1                       (the stream order)

    visited:   order[0] order[1] ... order[rows-1] | order[rows] ...            cursor (epoch, rows)
               └──────── already trained ────────┘   a resumed planner starts here

Row p of the tokenized stream keeps sample id p whatever the order, so samples.jsonl, the held-out split
(scheduling/holdout.py, a function of the id) and the resume checks mean what they meant without shuffling.
The data cursor (epoch, rows) counts rows *visited in this order*: a resumed planner recomputes the same
permutation and skips its first `rows` entries, so it continues exactly after the last row the checkpoint's
step consumed (docs/design.md §10).

Pure numpy (no Ray): the planner actor calls it once per epoch, tests call it directly.
"""

from __future__ import annotations

import numpy as np

_UINT64 = (1 << 64) - 1


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of range(num_rows) that epoch `epoch` visits (int64), for data.seed `seed`.

    It is the same on every process and for every worker count: it depends on (num_rows, seed, epoch)
    only, never on the DP/CP size, the batch size, the cursor or the process that computes it.
    SeedSequence hashes the words [seed, epoch] into PCG64's state identically on every platform, PCG64's
    stream is fixed bit for bit (NumPy's compatibility policy, NEP 19, covers the bit generators), and
    `Generator.permutation` is a Fisher-Yates shuffle drawing from that stream. NEP 19 lets a NumPy release
    change a Generator method's algorithm, so a checkpoint resumed under another NumPy version could see
    another order; within one environment (the run's, and a resume's) it is exact. Each epoch gets its
    own permutation (a new seed word), and a negative seed is taken modulo 2**64 (SeedSequence needs
    non-negative words).
    """
    if num_rows < 0 or epoch < 0:
        raise ValueError(f"epoch_order needs num_rows >= 0 and epoch >= 0, got {num_rows}, {epoch}")
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & _UINT64, epoch])))
    return generator.permutation(num_rows).astype(np.int64, copy=False)


def visit_order(num_rows: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """`epoch_order` when shuffling, else the stream order 0 .. num_rows - 1."""
    if shuffle:
        return epoch_order(num_rows, seed, epoch)
    return np.arange(num_rows, dtype=np.int64)
