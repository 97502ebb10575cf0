"""Every scheduling policy behind one call, `plan_step`, from one registry: name -> planning function.

| policy           | DP split              | micro-batches                        | inside a micro-batch  |
|------------------|-----------------------|--------------------------------------|-----------------------|
| skrull           | GDS (LPT by FLOPs)    | GDS strided, roll-back, count tried  | DACP + refinement     |
|                  |                       | by modeled time; whole-plan fallback | (or all sharded when  |
|                  |                       | to gds_only, balanced_packed or      | modeled faster)       |
|                  |                       | dynamic_cp when one models faster    |                       |
| static_cp        | data order, rank r::D | k consecutive sequences (k=1)        | all sharded           |
| static_cp_packed | data order, rank r::D | consecutive, packed to C per rank    | all sharded           |
| sorted           | LongAlign: sort, pack consecutive to C per rank, shuffle | all sharded           |
|                  | the groups (seeded), deal them round-robin to DP ranks   |                       |
| roundrobin       | GDS                   | GDS                                  | DACP round-robin      |
|                  |                       |                                      | (App. B.2), no refine |
| dacp_only        | data order, rank r::D | consecutive, packed to C*N tokens    | DACP + refinement     |
| gds_only         | GDS                   | GDS (fit: sum ceil(S/N) <= C)        | all sharded           |
| balanced_packed  | LPT by modeled FLOPs  | best-fit decreasing to C per rank    | all sharded           |
| dynamic_cp       | LPT by S^2            | equal-work buckets by S^2/d, packed  | each sequence at the  |
|                  |                       | to C per rank (Megatron-style)       | smallest 2^k fitting C|
| chunkflow        | LPT by tokens over    | one chunk of <= C tokens each: long  | nothing sharded; a    |
|                  | all D x N ranks (CP   | sequences cut into dependent chunks, | chunk attends to its  |
|                  | ranks act as DP)      | short ones packed best-fit           | sequence's earlier K/V|

skrull lives in scheduling.skrull, roundrobin and gds_only are plan_gds options (scheduling.gds),
balanced_packed (the strongest conventional baseline) is scheduling.balanced_packed, dynamic_cp
(Megatron-style per-sequence CP degrees) is scheduling.dynamic_cp, chunkflow (ChunkFlow's dependent
chunks) is scheduling.chunkflow, the rest are
scheduling.baselines. Every registry entry takes one PlanRequest (the batch and every knob a policy may
read) and passes on the knobs it uses, so plan_step is one lookup; POLICIES is the registry's names in
order. A new policy is one module and one entry here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduling.balanced_packed import balanced_packed
from scheduling.baselines import dacp_only, sorted_batching, static_cp, static_cp_packed
from scheduling.chunkflow import chunkflow
from scheduling.cost import CostModel
from scheduling.dacp import Placement, check_fits
from scheduling.dynamic_cp import dynamic_cp
from scheduling.gds import Execution, plan_gds
from scheduling.plans import SchedulingError, StepPlan
from scheduling.skrull import skrull


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """One global batch to plan and every knob a policy may read (each policy reads only its own)."""

    lengths: Sequence[int]
    dp_size: int
    cp_size: int
    bucket_size: int
    cost: CostModel
    seed: int = 0
    """Sorted batching's group shuffle."""
    static_cp_micro_batch: int = 1
    """static_cp's sequences per micro-batch."""
    labels: Sequence[int] | None = None
    """Label tokens per sequence (the model cost formula's LM head; None: every token)."""
    cp_degrees: str | Sequence[int] | None = None
    """scheduling.cp_degrees: skrull's DACP degrees and dynamic_cp's degree set."""
    baselines: bool = False
    """skrull only: balanced_packed and dynamic_cp are candidates too (online calibration)."""
    explore: int | None = None
    """skrull only: return its candidate plan explore mod 4 (online calibration's first steps)."""
    chunkflow_keep: int = 1
    """scheduling.chunkflow_keep: chunkflow's K, the chunks of a sequence that keep their activations."""

    @property
    def shape(self) -> dict[str, int]:
        """The DP x CP layout and the bucket, as every planner takes them."""
        return {"dp_size": self.dp_size, "cp_size": self.cp_size, "bucket_size": self.bucket_size}


class Policy(Protocol):
    """One policy: a StepPlan of `request.lengths` whose indices refer to them."""

    def __call__(self, request: PlanRequest) -> StepPlan: ...


def _skrull(r: PlanRequest) -> StepPlan:
    return skrull(r.lengths, **r.shape, cost=r.cost, labels=r.labels, cp_degrees=r.cp_degrees,
                  baselines=r.baselines, explore=r.explore)


def _static_cp(r: PlanRequest) -> StepPlan:
    return static_cp(r.lengths, **r.shape, micro_batch=r.static_cp_micro_batch)


def _static_cp_packed(r: PlanRequest) -> StepPlan:
    return static_cp_packed(r.lengths, **r.shape)


def _sorted(r: PlanRequest) -> StepPlan:
    return sorted_batching(r.lengths, **r.shape, seed=r.seed)


def _roundrobin(r: PlanRequest) -> StepPlan:
    return plan_gds(r.lengths, **r.shape, cost=r.cost, placement=Placement.ROUNDROBIN, refine=False,
                    labels=r.labels)


def _dacp_only(r: PlanRequest) -> StepPlan:
    return dacp_only(r.lengths, **r.shape, cost=r.cost, labels=r.labels)


def _gds_only(r: PlanRequest) -> StepPlan:
    return plan_gds(r.lengths, **r.shape, cost=r.cost, execution=Execution.STATIC, labels=r.labels)


def _balanced_packed(r: PlanRequest) -> StepPlan:
    return balanced_packed(r.lengths, **r.shape, cost=r.cost, labels=r.labels)


def _dynamic_cp(r: PlanRequest) -> StepPlan:
    return dynamic_cp(r.lengths, **r.shape, cp_degrees=r.cp_degrees)


def _chunkflow(r: PlanRequest) -> StepPlan:
    return chunkflow(r.lengths, **r.shape, keep=r.chunkflow_keep)


REGISTRY: dict[str, Policy] = {
    "skrull": _skrull,
    "static_cp": _static_cp,
    "static_cp_packed": _static_cp_packed,
    "sorted": _sorted,
    "roundrobin": _roundrobin,
    "dacp_only": _dacp_only,
    "gds_only": _gds_only,
    "balanced_packed": _balanced_packed,
    "dynamic_cp": _dynamic_cp,
    "chunkflow": _chunkflow,
}
"""Policy name (the value of `scheduling.policy`) -> planning function."""

POLICIES = tuple(REGISTRY)

ANY_LENGTH = frozenset({"chunkflow"})
"""Policies that train a sequence of any length (they cut it into chunks of at most C tokens), so neither
the planner nor the data pipeline caps sequences at C * N for them (app/config.py max_sequence_length)."""


def check_policy(name: str) -> str:
    """`name` if it names a registered policy, else SchedulingError naming `scheduling.policy`."""
    if name not in REGISTRY:
        raise SchedulingError(f"scheduling.policy={name!r} is not one of: {', '.join(POLICIES)}")
    return name


def plan_step(policy: str, lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
              cost: CostModel, seed: int = 0, static_cp_micro_batch: int = 1,
              labels: Sequence[int] | None = None,
              cp_degrees: str | Sequence[int] | None = None, baselines: bool = False,
              explore: int | None = None, chunkflow_keep: int = 1) -> StepPlan:
    """Plan one global batch with `policy` (one of POLICIES); indices in the plan refer to `lengths`.

    `labels`: label tokens per sequence, for the model cost formula's LM head (None: every token).
    `cp_degrees`: scheduling.cp_degrees, the CP degrees skrull's DACP may give a sequence (None: [1, N],
    the paper's two-level DACP; "auto": every power of two; docs/design.md §13) and dynamic_cp's degree set
    (None: every power of two); the other policies shard over the whole CP group.
    `baselines`: skrull also weighs balanced_packed and dynamic_cp; `explore`: skrull's candidate explore
    mod 4 instead of its fastest (scheduling/skrull.py). `chunkflow_keep`: scheduling.chunkflow_keep.
    """
    planner = REGISTRY[check_policy(policy)]
    if dp_size < 1:
        raise SchedulingError(f"DP size must be >= 1 (parallel.num_workers / parallel.cp_size): {dp_size}")
    check_fits(lengths, cp_size, bucket_size, bounded=policy not in ANY_LENGTH)
    return planner(PlanRequest(lengths=lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                               cost=cost, seed=seed, static_cp_micro_batch=static_cp_micro_batch,
                               labels=labels, cp_degrees=cp_degrees, baselines=baselines,
                               explore=explore, chunkflow_keep=chunkflow_keep))
