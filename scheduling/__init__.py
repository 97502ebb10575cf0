"""Skrull's data scheduler, pure Python (numpy only): lengths in, frozen plans over logical ranks out.

    cost.py          FLOPs / KV bytes / modeled seconds / BucketSize       (CostModel, HardwareProfile)
    plans.py         DacpPlan (one micro-batch of a CP group), StepPlan (one global batch)
    dacp.py          Algorithm 1: local vs distributed per micro-batch, consistent roll-back
    gds.py           Algorithm 2: LPT over DP ranks, strided micro-batches, equal counts per DP rank
    baselines.py     every policy behind plan_step (static CP, sorted, round-robin, ablations)
    simulate.py      modeled step time, perfect-balance bound, imbalances
    distributions.py seeded synthetic lengths of the paper's three datasets
    calibrate.py     fit a profile's mfu / micro-batch launch from measured times (bench compute)

No ray / torch / deepspeed import anywhere in this package (only scheduling/actor.py touches Ray, and it
is not imported here).
"""

from scheduling.baselines import POLICIES, plan_step
from scheduling.cost import CostModel, HardwareProfile, bucket_size_from_memory
from scheduling.dacp import plan_dacp
from scheduling.distributions import DISTRIBUTIONS, sample_lengths
from scheduling.gds import plan_gds
from scheduling.plans import DacpPlan, SchedulingError, StepPlan, shard_tokens
from scheduling.simulate import StepEstimate, simulate

__all__ = [
    "DISTRIBUTIONS", "POLICIES", "CostModel", "DacpPlan", "HardwareProfile", "SchedulingError",
    "StepEstimate", "StepPlan", "bucket_size_from_memory", "plan_dacp", "plan_gds", "plan_step",
    "sample_lengths", "shard_tokens", "simulate",
]
