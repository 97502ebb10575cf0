"""The eval set, planned like training: global batches of K samples, each planned with the run's policy.

    eval samples [e0 e1 ... e(n-1)]  (held-out rows in stream order, or data.eval_path's rows)
        -> batches of scheduling.global_batch_size (the last one partial)
        -> plan_step(policy, lengths, dp_size, cp_size, ...)          (the same GDS + DACP as a step)
        -> build_rank_payloads                                         one RankPayload per (dp, cp) rank
    rank (d, r) gets the tuple of its payloads over every eval batch, in batch order; a spare rank gets
    spare_payload's empty micro-batches (it computes nothing, but joins the loss all_reduce).

Each payload's `step` is the eval batch's index (1-based) and `global_label_tokens` that batch's label
tokens, so the eval loss of the whole set is

    eval_loss = sum over ranks and batches of CE sums / sum over batches of global_label_tokens

exactly the training loss normalization, over the whole eval set instead of one global batch. A partial
batch with fewer samples than DP ranks is fine: every policy gives each DP rank the same micro-batch count,
and a rank without a sequence runs the workers' idle micro-batch.

Pure: numpy only; the planner actor (scheduling/actor.py) calls it once per worker-group shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.cost import CostModel
from scheduling.payload import Cursor, RankPayload, Sample, build_rank_payloads, spare_payload
from scheduling.policies import plan_step


def eval_batches(samples: Sequence[Sample], batch_size: int) -> list[list[Sample]]:
    """Consecutive batches of `batch_size` samples; the last holds the remainder."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return [list(samples[i:i + batch_size]) for i in range(0, len(samples), batch_size)]


def plan_eval(samples: Sequence[Sample], *, policy: str, batch_size: int, dp_size: int, cp_size: int,
              bucket_size: int, cost: CostModel, seed: int = 0, static_cp_micro_batch: int = 1,
              spares: int = 0) -> dict[tuple[int, int], tuple[RankPayload, ...]]:
    """Every rank's eval payloads: keys (dp, cp) for trained ranks and (-1, i) for spare i.

    ValueError when there is no eval sample (the driver rejects that as a ConfigError first).
    """
    if not samples:
        raise ValueError("the eval set is empty")
    per_rank: dict[tuple[int, int], list[RankPayload]] = {}
    for index, batch in enumerate(eval_batches(samples, batch_size), start=1):
        lengths = [sample.num_tokens for sample in batch]
        labels = [sample.num_label_tokens for sample in batch]
        step_plan = plan_step(policy, lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                              cost=cost, seed=seed + index, static_cp_micro_batch=static_cp_micro_batch,
                              labels=labels)
        payloads = build_rank_payloads(step_plan, batch, step=index, epoch=0, cursor=Cursor(epoch=0, rows=0),
                                       plan_ms=0.0)
        for index_spare in range(spares):
            payloads[-1, index_spare] = spare_payload(payloads[0, 0], index_spare)
        for rank, payload in payloads.items():
            per_rank.setdefault(rank, []).append(payload)
    return {rank: tuple(payloads) for rank, payloads in per_rank.items()}
