"""Planned global batches for the engine tests: random token ids per sequence length, the first third of each
sequence's labels ignored, planned by the skrull policy and cut into every rank's payload."""

from __future__ import annotations

import numpy as np

from scheduling import CostModel, plan_step
from scheduling.payload import IGNORE_INDEX, Cursor, Sample, build_rank_payloads


def planned_steps(lengths_by_step: tuple[list[int], ...], *, vocab: int, bucket_size: int,
                  cp_size: int = 1) -> list:
    """One {(dp_rank, cp_rank): RankPayload} per step (DP 1), step s's ids drawn from seed s."""
    cost = CostModel.from_model_dims(hidden_size=32, kv_hidden_size=16, num_layers=2)
    payloads = []
    for step, lengths in enumerate(lengths_by_step, start=1):
        samples = labelled_samples(lengths, vocab=vocab, seed=step)
        plan = plan_step("skrull", lengths, dp_size=1, cp_size=cp_size, bucket_size=bucket_size, cost=cost)
        payloads.append(build_rank_payloads(plan, samples, step=step, epoch=0,
                                            cursor=Cursor(epoch=0, rows=len(lengths) * step), plan_ms=0.0))
    return payloads


def labelled_samples(lengths: list[int], *, vocab: int, seed: int) -> list[Sample]:
    """A sample per length: ids drawn from `seed`, the first third of its labels ignored."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = rng.integers(1, vocab, size=n)
        labels = ids.copy()
        labels[: n // 3] = IGNORE_INDEX
        samples.append(Sample(sample_id=i, input_ids=ids, labels=labels))
    return samples
