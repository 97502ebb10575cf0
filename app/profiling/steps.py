"""Whole training steps for `python -m app profile`: plan them, then fit how far the isolated terms are off.

The other measurements of `profile` time one part at a time (a micro-batch's forward+backward repeated on
one shape, one ring step, one reduction, one optimizer step). A real step strings them together over
shapes that change every micro-batch; on a 2-core CPU host it measured ~20% slower than the sum of its
parts. So `profile` also trains a few real steps: `scheduling.global_batch_size` sequences from the run's
length source (`app/plan_report.sample_batches`), each planned by several policies (different micro-batch
counts and sharding), run by the workers' own `run_step` on random token ids with the last half of every
sequence labeled. `fit_step_scale` then gives the factor k between measured and modeled steps, and
`scaled_fields` folds k into every time term of the profile (docs/benchmarks.md shows the effect).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.config import SkrullConfig
from scheduling import CostModel, StepPlan, plan_step, simulate
from scheduling.calibrate import StepScaleFit, fit_step_scale
from scheduling.cost import HardwareProfile
from scheduling.payload import IGNORE_INDEX, Cursor, RankPayload, Sample, build_rank_payloads

STEP_POLICIES = ("skrull", "static_cp_packed", "static_cp")
"""Policies whose plans of the same batch are timed: from few micro-batches to one sequence each."""

LABEL_FRACTION = 0.5
"""Share of every sequence that carries labels (its end, as a chat's answer does)."""

TOKEN_IDS = 256
"""Token ids are drawn below this: valid in any vocabulary, and a step's time does not depend on them."""


@dataclass(frozen=True, slots=True)
class PlannedStep:
    """One global batch planned by one policy, and the per-rank payloads the workers run."""

    policy: str
    plan: StepPlan
    lengths: tuple[int, ...]
    labels: tuple[int, ...]
    payloads: dict[tuple[int, int], RankPayload]


def _samples(lengths: np.ndarray, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for index, length in enumerate(int(n) for n in lengths):
        ids = rng.integers(0, TOKEN_IDS, size=length, dtype=np.int64)
        labels = ids.copy()
        labels[: length - max(2, round(length * LABEL_FRACTION))] = IGNORE_INDEX
        samples.append(Sample(sample_id=index, input_ids=ids, labels=labels))
    return samples


def planned_steps(config: SkrullConfig, cost: CostModel, *, num_batches: int,
                  world_size: int) -> list[PlannedStep]:
    """`num_batches` global batches of the run's lengths, each planned by every STEP_POLICIES policy."""
    from app.profiling.plan_report import sample_batches

    sched = config.scheduling
    cp_size = config.parallel.cp_size
    dp_size = world_size // cp_size
    batches, _ = sample_batches(dataclasses.replace(
        config, plan=dataclasses.replace(config.plan, num_batches=num_batches)))
    steps = []
    for number, lengths in enumerate(batches[:num_batches]):
        samples = _samples(lengths, seed=config.train.seed + number)
        labels = tuple(s.num_label_tokens for s in samples)
        for policy in STEP_POLICIES:
            plan = plan_step(policy, lengths.tolist(), dp_size=dp_size, cp_size=cp_size,
                             bucket_size=sched.bucket_size, cost=cost, seed=number,
                             static_cp_micro_batch=sched.static_cp_micro_batch, labels=labels)
            payloads = build_rank_payloads(plan, samples, step=number + 1, epoch=0,
                                           cursor=Cursor(epoch=0, rows=0), plan_ms=0.0)
            steps.append(PlannedStep(policy=policy, plan=plan, lengths=tuple(int(n) for n in lengths),
                                     labels=labels, payloads=payloads))
    return steps


def fit_steps(steps: list[PlannedStep], measured_s: list[float], cost: CostModel) -> StepScaleFit:
    """k between the measured steps and the steps `cost` (the isolated terms' fit) models."""
    predicted = [simulate(s.plan, s.lengths, cost, labels=s.labels).total_s for s in steps]
    return fit_step_scale(predicted, measured_s)


def scaled_fields(fields: dict[str, float], scale: float) -> dict[str, float]:
    """The measured profile fields with every time term multiplied by `scale` (rates divided by it)."""
    factor = {f.name: {"time": scale, "rate": 1.0 / scale}.get(f.metadata.get("scales_as"), 1.0)
              for f in dataclasses.fields(HardwareProfile)}
    return {key: value * factor[key] for key, value in fields.items()}


def fitted_cost(cost: CostModel, fields: dict[str, Any]) -> CostModel:
    """`cost` with the profile's measured fields replaced."""
    return dataclasses.replace(cost, profile=dataclasses.replace(cost.profile, **fields))
