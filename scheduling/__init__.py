"""Skrull's data scheduler, pure Python (numpy only): lengths in, frozen plans over logical ranks out.

    cost.py          FLOPs / KV bytes / modeled seconds / BucketSize       (CostModel, HardwareProfile)
    plans.py         DacpPlan (one micro-batch of a CP group), SubgroupShards (its per-sequence CP
                     degrees between 1 and N), StepPlan (one global batch)
    dacp_state.py    DACP's working state (RB, L, placement) and its moves, shared by dacp and refine
    dacp.py          Algorithm 1: local vs distributed per micro-batch, consistent roll-back
    dacp_degrees.py  per-sequence CP degrees 1..N on aligned subgroups (scheduling.cp_degrees, design §13)
    refine.py        cost-model refinement of a DACP placement (beyond the paper)
    gds.py           Algorithm 2: LPT over DP ranks, strided micro-batches, equal counts per DP rank
    skrull.py        the skrull policy: GDS + DACP, or a candidate (GDS-only, balanced_packed, dynamic_cp)
                     that models faster
    baselines.py     static CP, packed static CP, sorted batching, the DACP-only ablation
    dynamic_cp.py    Megatron-style dynamic CP: smallest fitting power-of-two degree, S^2-balanced buckets
    policies.py      the policy registry (name -> planner), POLICIES, plan_step, check_policy
    simulate.py      modeled step time, perfect-balance bound, imbalances
    distributions.py seeded synthetic lengths of the paper's three datasets
    calibrate.py     fit a profile's mfu / micro-batch launch from measured times (bench compute)
    refit.py         online calibration: refit a profile's time terms from a run's measured micro-batches
    calibration.py   the planner's calibration state: recent plans, their laps, the newest fit
    order.py         an epoch's visiting order: data.shuffle's seeded permutation (the planner actor's)
    row_table.py     the planner's random access to tokenized rows by stream position

No ray / torch / deepspeed import anywhere in this package (only scheduling/actor.py touches Ray, and it
is not imported here).
"""

from scheduling.cost import CostModel, HardwareProfile, bucket_size_from_memory
from scheduling.dacp import plan_dacp
from scheduling.distributions import DISTRIBUTIONS, sample_lengths
from scheduling.gds import plan_gds
from scheduling.plans import DacpPlan, SchedulingError, StepPlan, SubgroupShards, shard_tokens
from scheduling.policies import POLICIES, check_policy, plan_step
from scheduling.simulate import StepEstimate, simulate

__all__ = [
    "DISTRIBUTIONS", "POLICIES", "CostModel", "DacpPlan", "HardwareProfile", "SchedulingError",
    "StepEstimate", "StepPlan", "SubgroupShards", "bucket_size_from_memory", "check_policy", "plan_dacp",
    "plan_gds", "plan_step", "sample_lengths", "shard_tokens", "simulate",
]
