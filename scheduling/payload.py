"""What one (dp, cp) rank receives for one optimizer step: its micro-batches' plans and token ids.

A global batch of K samples is planned once (a `StepPlan` over logical ranks). For every DP rank d and CP
rank r, the rank's payload carries, per micro-batch, the DACP plan of that micro-batch and the token ids of
only the sequences rank r needs: its own local sequences (whole) plus every distributed sequence and every
sequence of a partial entry (DacpPlan.partial) whose subgroup holds r (the worker cuts its shards).
Sequences local to the other CP ranks, and those sharded over subgroups without r, are not shipped.
A dependent chunk (DacpPlan.chunks, the chunkflow policy) ships its whole sequence, whose targets are
shifted before the worker cuts the chunk out; the sequence's micro-batches share one array (pickled once).

    global batch  [s0 s1 s2 s3 s4 s5 s6 s7]            (indices into the batch)
    DP rank 0, micro-batch 0:  local=((s0, s5), (s2,))   distributed=(s7,)
        payload (dp=0, cp=0): ids of s0, s5, s7          payload (dp=0, cp=1): ids of s2, s7

Pure: numpy only, so it is tested without Ray.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from scheduling.plans import DacpPlan

if TYPE_CHECKING:
    from collections.abc import Sequence

    from scheduling import StepPlan
    from scheduling.simulate import StepEstimate

IGNORE_INDEX = -100
"""Label of a token that carries no loss (the Hugging Face / PyTorch cross-entropy convention)."""


class RowStatus(StrEnum):
    """What tokenization says of a row (app/data/template.py); the planner trains on USABLE_STATUSES only.

    truncated_empty: a row that data.too_long=truncate cut to a window without a single label token (after
    the shift); it is counted, carries empty ids and is never trained on. excluded: a row with no label token
    because its per-message `train: false` / `weight: 0` fields left out every message the label rule
    would train (counted and skipped like empty).
    """

    OK = "ok"
    EMPTY = "empty"
    EXCLUDED = "excluded"
    MALFORMED = "malformed"
    TRUNCATED = "truncated"
    TRUNCATED_EMPTY = "truncated_empty"
    DROPPED = "dropped"
    TOO_LONG = "too_long"


ROW_STATUSES = tuple(RowStatus)
USABLE_STATUSES = (RowStatus.OK, RowStatus.TRUNCATED)
"""Rows with >= 1 label token after truncation and the shift (the tokenizer guarantees it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One tokenized training sequence; labels follow the HF convention (unshifted, -100 = no loss)."""

    sample_id: int
    input_ids: np.ndarray
    labels: np.ndarray
    source: str = ""
    """The id of the data.sources entry it came from ("" without data.sources)."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels) or len(self.input_ids) == 0:
            raise ValueError(f"sample {self.sample_id}: input_ids and labels must be equal and non-empty")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_label_tokens(self) -> int:
        """Tokens that are a next-token target: labels shifted by one, as the loss sees them."""
        return int(np.count_nonzero(self.labels[1:] != IGNORE_INDEX))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cursor:
    """Position in the deterministic data stream: `rows` rows of epoch `epoch` have been consumed."""

    epoch: int
    rows: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatchPayload:
    """One micro-batch for one CP rank; `plan` indices are keys of `input_ids` / `labels`."""

    plan: DacpPlan
    input_ids: dict[int, np.ndarray]
    labels: dict[int, np.ndarray]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPayload:
    """Everything a (dp_rank, cp_rank) worker needs for one optimizer step."""

    step: int
    epoch: int
    dp_rank: int
    cp_rank: int
    micro_batches: tuple[MicroBatchPayload, ...]
    global_label_tokens: int
    """Label tokens of the whole global batch: every rank divides its loss sum by this."""
    global_tokens: int
    sample_ids_by_dp_rank: tuple[tuple[int, ...], ...]
    """For the run's samples.jsonl audit log: which samples each DP rank trained on this step."""
    cursor: Cursor
    """Data position after this step: a checkpoint taken after it resumes from here."""
    plan_ms: float
    predicted_step_s: float = math.nan
    """The cost model's step time for the whole plan (scheduling/simulate.py); NaN when not modeled."""
    predicted_busy_s: float = math.nan
    """The cost model's busy time of this (dp_rank, cp_rank) over its micro-batches; NaN when not modeled."""
    subgroup_token_fraction: float = 0.0
    """Share of the global batch's tokens in sequences sharded over a CP subgroup (a degree 1 < d < N,
    DacpPlan.partial; docs/design.md §13): how much of the step per-sequence CP degrees moved."""
    flops_at_peak_s: float = math.nan
    """The global batch's model training FLOPs (the cost model's forward FLOPs x train_flops_factor) over the
    hardware profile's peak_flops: seconds one device at peak would take (the workers' mfu); NaN: unknown."""
    predicted_step_s_initial: float = math.nan
    """predicted_step_s under the run's starting profile (hardware.profile), for the same plan."""
    source_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    """Tokens of the global batch by data.sources id ({} without data.sources): the mix a step trained on."""


def _sequences_needed(plan: DacpPlan, cp_rank: int) -> tuple[int, ...]:
    """Rank r's local sequences, every distributed one, and every sequence of the partial entries whose
    subgroup holds r (per-sequence CP degrees: the worker cuts its shard of those too)."""
    partial = tuple(i for entry in plan.partial_on(cp_rank) for i in entry.indices)
    return tuple(plan.local[cp_rank]) + tuple(plan.distributed) + partial


def build_rank_payloads(
    step_plan: StepPlan,
    samples: Sequence[Sample],
    *,
    step: int,
    epoch: int,
    cursor: Cursor,
    plan_ms: float,
    estimate: StepEstimate | None = None,
    flops_at_peak_s: float = math.nan,
    predicted_step_s_initial: float = math.nan,
) -> dict[tuple[int, int], RankPayload]:
    """Split one planned global batch into per-(dp_rank, cp_rank) payloads.

    `estimate`: the cost model's times of the plan, carried so the workers can report predicted beside
    measured time.
    `flops_at_peak_s`: RankPayload.flops_at_peak_s of the step (the workers' mfu); `predicted_step_s_initial`:
    the starting profile's time of the same plan (RankPayload).

    ValueError if the global batch has no label token: every rank would divide a zero loss sum by
    max(0, 1) and the run would report loss 0.0 while training on nothing. Usable rows always carry a label
    token (app/data/template.py), so this guards against a pipeline bug, not against user data.
    """
    label_tokens = sum(sample.num_label_tokens for sample in samples)
    if label_tokens == 0:
        raise ValueError(
            f"step {step}: the global batch of {len(samples)} samples has no label token (nothing to train "
            "on, the loss would be a silent 0.0); check data.labels (assistant needs assistant turns), "
            "data.too_long and data.truncate_side (truncation can cut every answer away)"
        )
    tokens = sum(sample.num_tokens for sample in samples)
    source_tokens: dict[str, int] = {}
    for sample in samples:
        if sample.source:
            source_tokens[sample.source] = source_tokens.get(sample.source, 0) + sample.num_tokens
    subgroup_tokens = sum(samples[i].num_tokens for per_dp in step_plan.micro_batches for mb in per_dp
                          for entry in mb.partial for i in entry.indices)
    sample_ids = tuple(  # a chunked sequence (chunkflow) sits in several micro-batches: listed once
        tuple(dict.fromkeys(samples[i].sample_id for mb in per_dp for i in mb.indices))
        for per_dp in step_plan.micro_batches
    )
    payloads: dict[tuple[int, int], RankPayload] = {}
    for dp_rank, per_dp in enumerate(step_plan.micro_batches):
        for cp_rank in range(step_plan.cp_size):
            micro_batches = tuple(
                MicroBatchPayload(
                    plan=mb,
                    input_ids={i: samples[i].input_ids for i in _sequences_needed(mb, cp_rank)},
                    labels={i: samples[i].labels for i in _sequences_needed(mb, cp_rank)},
                )
                for mb in per_dp
            )
            payloads[dp_rank, cp_rank] = RankPayload(
                step=step, epoch=epoch, dp_rank=dp_rank, cp_rank=cp_rank, micro_batches=micro_batches,
                global_label_tokens=label_tokens, global_tokens=tokens,
                sample_ids_by_dp_rank=sample_ids, cursor=cursor, plan_ms=plan_ms,
                predicted_step_s=estimate.total_s if estimate else math.nan,
                predicted_busy_s=estimate.rank_busy_s[dp_rank][cp_rank] if estimate else math.nan,
                flops_at_peak_s=flops_at_peak_s, subgroup_token_fraction=subgroup_tokens / max(tokens, 1),
                predicted_step_s_initial=predicted_step_s_initial, source_tokens=source_tokens,
            )
    return payloads


def spare_payload(payload: RankPayload, index: int) -> RankPayload:
    """What a spare rank (workers/distributed.py) trains on: the step's facts with every micro-batch empty.

    The micro-batch count stays, because ZeRO-2 needs every rank to run as many backward passes as the
    others; each empty micro-batch becomes a no-target idle micro-batch on the worker (zero gradient). A
    spare has no CP group, so its plans are over one rank.
    """
    empty = MicroBatchPayload(plan=DacpPlan(local=((),), distributed=()), input_ids={}, labels={})
    return dataclasses.replace(payload, dp_rank=-1, cp_rank=index,
                               micro_batches=(empty,) * len(payload.micro_batches))
