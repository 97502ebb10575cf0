"""Online calibration (scheduling/refit.py): a synthetic machine whose micro-batches take the times of a
profile the test chose, with noise, and the fit recovers each of that profile's time terms from the steps
skrull's planner runs over its calibration window (its candidates in turn, scheduling/skrull.py), and
predicts the steps of any policy from that policy's own steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from scheduling import CostModel, DacpPlan, HardwareProfile, StepPlan, plan_step, sample_lengths, simulate
from scheduling.cost import SubgroupClock
from scheduling.refit import PlannedStep, StepTiming, refit
from scheduling.simulate import plan_times

CP, BUCKET, BATCH = 2, 512, 32
NOISE = 0.01
"""Multiplicative noise of every measured micro-batch."""


def _cost(profile: HardwareProfile) -> CostModel:
    """The CPU bench model (configs/bench/cpu-lmsys.yaml) on `profile`."""
    return CostModel.from_model_dims(hidden_size=256, kv_hidden_size=128, num_layers=6, profile=profile,
                                     formula="model", intermediate_size=1024, vocab_size=773)


def _committed_cpu() -> HardwareProfile:
    with open("configs/hardware/cpu.yaml") as handle:
        return HardwareProfile.from_dict(yaml.safe_load(handle))


def _slow_ring(base: HardwareProfile) -> HardwareProfile:
    """`base` with a ring step of ~4 ms (a slow link): the ring then takes ~10% of a sharded micro-batch
    instead of the CPU profile's ~1%, so that, under 1% noise, there is something to measure: a term that
    moves the measured time by less than the noise cannot be told apart from it, by any fit."""
    return dataclasses.replace(base, intra_node_latency_s=4e-3, intra_node_comm_offset_s=4e-3)


def _truth(base: HardwareProfile, ring: float = 2.0) -> HardwareProfile:
    """The machine: compute 1.4x slower, every ring term `ring` x, launch +30%, a sharded sequence 1 ms per
    ring step and layer, a faster optimizer."""
    return dataclasses.replace(
        base, mfu=base.mfu / 1.4, micro_batch_launch_s=base.micro_batch_launch_s * 1.3,
        intra_node_latency_s=base.intra_node_latency_s * ring,
        intra_node_comm_offset_s=base.intra_node_comm_offset_s * ring,
        intra_node_bandwidth=base.intra_node_bandwidth / ring,
        inter_node_latency_s=base.inter_node_latency_s * ring,
        inter_node_comm_offset_s=base.inter_node_comm_offset_s * ring,
        inter_node_bandwidth=base.inter_node_bandwidth / ring,
        ring_sequence_step_s=1e-3, optimizer_s_per_param=1.5e-8)


def _measure(policy: str, steps: int, start: CostModel, truth: CostModel, seed: int = 0,
             explore: bool = False) -> tuple[dict[int, PlannedStep], list[StepTiming]]:
    """`steps` global batches planned by `policy` under `start`, timed by `truth` with noise; with
    `explore`, skrull's candidates in turn (what its planner does over the calibration window)."""
    rng = np.random.default_rng(seed)
    planned, timings = {}, []
    for step in range(1, steps + 1):
        lengths = np.minimum(sample_lengths("lmsys", BATCH, seed=seed * 1000 + step) // 4, BUCKET * CP)
        lengths = np.maximum(lengths, 2).tolist()
        plan = plan_step(policy, lengths, dp_size=1, cp_size=CP, bucket_size=BUCKET, cost=start,
                         explore=step if explore else None)
        planned[step] = PlannedStep(plan=plan, lengths=tuple(lengths))
        flops = truth.sequence_flops(lengths)
        kv = truth.kv_bytes(np.asarray(lengths, dtype=np.float64)).tolist()
        clock = SubgroupClock(truth, CP, CP)
        times = [max(plan_times(mb, flops, kv, clock)) * (1 + NOISE * rng.standard_normal())
                 for mb in plan.micro_batches[0]]
        optimizer = truth.optimizer_step_s(CP) * (1 + NOISE * rng.standard_normal())
        timings.append(StepTiming(step=step, micro_batch_s=tuple(times), optimizer_s=optimizer,
                                  first_of_session=step == 1))
    return planned, timings


def test_the_fit_recovers_each_planted_term_within_5_percent() -> None:
    """Two calibration windows of skrull's exploring steps (16), 1% noise, on a machine whose every term
    shows (_slow_ring)."""
    base = _slow_ring(_committed_cpu())
    truth = _truth(base)
    start, machine = _cost(base), _cost(truth)
    planned, timings = _measure("skrull", 16, start, machine, explore=True)
    fit = refit(start, planned, timings, world=CP)
    assert fit is not None and 1 not in fit.steps  # the session's first step is left out
    got = fit.profile
    for name in ("mfu", "micro_batch_launch_s", "intra_node_latency_s", "intra_node_comm_offset_s",
                 "intra_node_bandwidth", "ring_sequence_step_s", "optimizer_s_per_param"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert fit.error_after < 0.02 < 0.1 < fit.error_before


@pytest.mark.parametrize("policy", ["skrull", "static_cp_packed", "static_cp", "dynamic_cp", "sorted"])
def test_any_policy_is_predicted_from_its_own_steps(policy: str) -> None:
    """A baseline's planner sees only its own plans, which may not tell every term apart (static_cp shards
    one sequence per micro-batch, always): the prior keeps what the steps cannot show, and the steps it
    runs are predicted within 5% (2% noise)."""
    global NOISE
    base = _committed_cpu()
    start, machine = _cost(base), _cost(_truth(base))
    NOISE, noise = 0.02, NOISE
    try:
        planned, timings = _measure(policy, 8, start, machine, seed=2)
    finally:
        NOISE = noise
    fit = refit(start, planned, timings, world=CP)
    assert fit is not None
    fitted = _cost(fit.profile)
    errors = [simulate(s.plan, s.lengths, fitted).total_s / simulate(s.plan, s.lengths, machine).total_s - 1
              for s in planned.values()]
    assert np.median(np.abs(errors)) < 0.05, errors


@pytest.mark.parametrize("machine_speed", [1 / 1.4, 1.9])
def test_a_profile_three_times_too_slow_or_fast_is_corrected(machine_speed: float) -> None:
    """Every time term x3 (and x1/3) on a machine 1.4x slower or 1.9x faster than the committed profile
    (the bench machine computes ~1.9x faster than configs/hardware/cpu.yaml says, measured 2026-11-27):
    from x3 the compute is then 5.7x off, beyond any bound of a few x. The fitted profile predicts the
    measured steps within 5%."""
    base = _committed_cpu()
    truth = _truth(base)
    truth = dataclasses.replace(truth, mfu=base.mfu * machine_speed,
                                micro_batch_launch_s=truth.micro_batch_launch_s / machine_speed)
    machine = _cost(truth)
    for factor in (3.0, 1 / 3):
        scale = {"time": factor, "rate": 1 / factor}
        fields = {f.name: getattr(base, f.name) * scale[f.metadata["scales_as"]]
                  for f in dataclasses.fields(HardwareProfile) if f.metadata.get("scales_as")}
        start = _cost(dataclasses.replace(base, **fields))
        planned, timings = _measure("skrull", 10, start, machine, seed=1)
        fit = refit(start, planned, timings, world=CP)
        assert fit is not None
        assert fit.profile.mfu == pytest.approx(truth.mfu, rel=0.1)  # no bound on how far a term may be off
        fitted = _cost(fit.profile)
        for step in planned.values():
            want = simulate(step.plan, step.lengths, machine).total_s
            assert simulate(step.plan, step.lengths, fitted).total_s == pytest.approx(want, rel=0.05)


def test_too_little_data_keeps_the_profile() -> None:
    start = _cost(_committed_cpu())
    planned, timings = _measure("skrull", 2, start, start)
    assert refit(start, planned, timings, world=CP) is None  # one usable step
    assert refit(start, {}, timings, world=CP) is None  # steps the planner does not know


def test_a_window_without_sharding_keeps_the_ring_terms() -> None:
    """Nothing sharded, nothing learned about the ring: its terms stay where they were."""
    base = _committed_cpu()
    start, machine = _cost(base), _cost(_truth(base))
    rng = np.random.default_rng(3)
    planned, timings = {}, []
    for step in range(1, 8):
        lengths = rng.integers(20, 200, size=BATCH).tolist()
        plan = StepPlan(micro_batches=((*(DacpPlan(local=(tuple(range(k, k + 4)), tuple(range(k + 4, k + 8))),
                                                    distributed=()) for k in range(0, BATCH, 8)),),))
        planned[step] = PlannedStep(plan=plan, lengths=tuple(lengths))
        estimate = simulate(plan, lengths, machine)
        per_mb = estimate.step_s / plan.num_micro_batches
        timings.append(StepTiming(step=step, micro_batch_s=(per_mb,) * plan.num_micro_batches,
                                  optimizer_s=0.01))
    fit = refit(start, planned, timings, world=CP)
    assert fit is not None
    assert fit.profile.intra_node_latency_s == pytest.approx(base.intra_node_latency_s, rel=1e-3)
    assert fit.profile.ring_sequence_step_s == pytest.approx(0.0, abs=1e-9)
