"""Online calibration: refit a hardware profile's time terms from the run's own measured micro-batches.

Every micro-batch the workers run is a measurement: its wall time t (the mean over the trained ranks of
each rank's lap; the ZeRO gradient reduction at the end of every backward and the CP ring synchronize the
ranks, so their laps agree) beside its plan on every DP rank, which the planner made. Under the profile in
use the model's time of a micro-batch is the max over (DP rank, CP rank j) of

    Time_j = overlapped(c_j, l_j) + s_j + b + k_j * q                               (scheduling/simulate.py)

    c_j  j's ring seconds (its rings' T_comm)      l_j  T_comp(j's local FLOPs)     s_j  T_comp(j's shards)
    b    the micro-batch overhead b(W)             k_j  sum over j's sharded sequences of L * d
    q    ring_sequence_step_s                      overlapped(c, l) = c + l - o * min(c, l), o = ring_overlap

For the rank the current terms make critical, with the overlap resolved by which of c and l is smaller
(c <= l: (1 - o) c + l, else c + (1 - o) l), the time is linear in four unknowns

    t = x_compute * K_compute + x_ring * K_ring + b + k * q

where x_compute and x_ring are that rank's compute and ring seconds as the overlap leaves them, and the
factors K say how far the profile's compute and ring terms are off (1: right). The fit:

- maximum a posteriori: relative residuals (every micro-batch weighs alike, short or long) in units of
  the window's noise sigma (1.48 x their median, >= 1%), against a Gaussian prior centred on the profile in
  use (`_prior_spread`: about 50% for each factor) — where the window's micro-batches cannot tell two
  terms apart (all packed alike: compute against overhead) the prior keeps their split and the data move
  only what they show; a term the window cannot see at all (no sharded micro-batch) keeps its value;
- Huber-reweighted (IRLS): a residual beyond 1.5 sigma counts 1.5 sigma / |r|, beyond 7.5 sigma nothing
  (a GC pause, a neighbour's burst);
- bounds (K_compute and K_ring within [1/50, 50] of the anchor, b >= 0, q >= 0) by fixing a violating term at
  its bound and solving again;
- three rounds: the critical rank and the overlap regimes are re-derived from the fitted terms, since the
  max over ranks makes the time piecewise linear.

The optimizer step is measured apart: optimizer_s_per_param = median optimizer seconds * W / P. Steps
that are the first of their worker group's start (allocator, first calls: `first_of_session`) are left out.

Written back (`Refit.profile`): mfu / K_compute; every ring latency and offset * K_ring, every ring
bandwidth / K_ring; micro_batch_launch_s + (b - b_now) (below 0, the rest slows the gradient collective:
grad_reduce_bandwidth); ring_sequence_step_s = q; optimizer_s_per_param as above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduling.cost import CostModel, HardwareProfile, SubgroupClock
from scheduling.plans import DacpPlan, StepPlan

TERMS = ("compute", "ring", "micro_batch_s", "ring_sequence_step_s")
"""The fitted unknowns, in column order: two factors on the profile's terms, then two times in seconds."""
_LOWER = np.array([0.02, 0.02, 0.0, 0.0])
_UPPER = np.array([50.0, 50.0, np.inf, np.inf])
"""Every fit is relative to the run's anchor (the starting profile), so these bound how far off that profile
may be, not one fit's step: 50x either way. The bench machine computes ~1.9x faster than its committed
profile says (2026-11-27), so a profile with every time term x3 is 5.7x off in compute; an assumed GPU
profile (an MFU guessed for a large model, a small one run) can be further. What a window cannot pin
(a term that is a small share of the time) the prior holds (`_prior_rows`), not the bounds."""
_ROUNDS = 3
_IRLS = 6
PRIOR_SPREAD = 1.0
"""The prior's standard deviation of the compute factor, and of the other terms around it (`_prior_rows`):
wide, so that a window's micro-batches outweigh it wherever they show a term (a factor of 0.2 or 3 is
within two spreads); it decides only what the window cannot tell apart."""
MIN_NOISE = 0.01
"""The smallest relative noise a window's residuals are weighed by (a perfect fit must not make the data
infinitely certain)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTiming:
    """What the workers measured of one step: each micro-batch's wall time and the optimizer step's."""

    step: int
    micro_batch_s: tuple[float, ...]
    optimizer_s: float
    first_of_session: bool = False
    """The first step of a worker group's start: slower for reasons the model does not hold; left out."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedStep:
    """What the planner made of one step: its plan over the global batch's lengths and label counts."""

    plan: StepPlan
    lengths: tuple[int, ...]
    labels: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Refit:
    """One fit's result: the profile to plan with and what was learned."""

    profile: HardwareProfile
    factors: dict[str, float]
    """TERMS -> fitted value (compute and ring: factors on the previous profile; the others: seconds)."""
    steps: tuple[int, ...]
    """The steps whose micro-batches were fitted."""
    micro_batches: int
    error_before: float
    """Median |predicted - measured| / measured over the fitted steps, under the previous profile."""
    error_after: float
    """The same under the fitted profile (in sample)."""

    def to_dict(self) -> dict[str, object]:
        fields = {f.name: getattr(self.profile, f.name) for f in dataclasses.fields(HardwareProfile)}
        return {"profile": fields, "factors": dict(self.factors), "steps": list(self.steps),
                "micro_batches": self.micro_batches, "error_before": self.error_before,
                "error_after": self.error_after}


@dataclass(frozen=True, slots=True)
class _RankTerms:
    """One (DP rank, CP rank)'s parts of a micro-batch under the profile in use (module docstring)."""

    ring_s: float
    local_s: float
    shard_s: float
    sequence_steps: float


def rank_terms(plan: DacpPlan, flops: Sequence[float], kv: Sequence[float], clock: SubgroupClock,
               num_layers: int) -> list[_RankTerms]:
    """c_j, l_j, s_j, k_j of every CP rank of one micro-batch (the parts of mixed_placement_times)."""
    base, n = clock.base, clock.cp_size
    ring = [base.comm(sum(kv[i] for i in plan.distributed))] * n
    shard = [sum(flops[i] for i in plan.distributed) / n] * n
    steps = [float(len(plan.distributed) * num_layers * n) if n > 1 else 0.0] * n  # CP 1: nothing sharded
    for entry in plan.partial:
        entry_ring = clock.ring(entry.degree, entry.group, sum(kv[i] for i in entry.indices))
        work = sum(flops[i] for i in entry.indices) / entry.degree
        for r in range(entry.group * entry.degree, (entry.group + 1) * entry.degree):
            ring[r] += entry_ring
            shard[r] += work
            steps[r] += len(entry.indices) * num_layers * entry.degree
    return [_RankTerms(ring[j], base.comp(sum(flops[i] for i in plan.local[j])), base.comp(shard[j]),
                       steps[j]) for j in range(n)]


def _row(terms: _RankTerms, overlap: float) -> np.ndarray:
    """The linear row (x_compute, x_ring, 1, k) of one rank, its overlap regime resolved."""
    if terms.ring_s <= terms.local_s:
        compute, ring = terms.local_s, (1 - overlap) * terms.ring_s
    else:
        compute, ring = (1 - overlap) * terms.local_s, terms.ring_s
    return np.array([compute + terms.shard_s, ring, 1.0, terms.sequence_steps])


def _time(terms: _RankTerms, theta: np.ndarray, overlap: float) -> float:
    """The rank's modeled time with the terms scaled by theta (the overlap evaluated, not linearized)."""
    ring, local = terms.ring_s * theta[1], terms.local_s * theta[0]
    return (ring + local - overlap * min(ring, local) + terms.shard_s * theta[0] + theta[2]
            + terms.sequence_steps * theta[3])


class _Observations:
    """Every fitted micro-batch's per-rank terms and measured time, under the profile in use."""

    def __init__(self, planned: dict[int, PlannedStep], timings: Sequence[StepTiming],
                 cost: CostModel) -> None:
        self.ranks: list[list[_RankTerms]] = []
        self.seconds: list[float] = []
        for timing in timings:
            step = planned[timing.step]
            if step.plan.has_chunks:  # chunkflow: laps follow its chunk schedule, not the plan's order
                continue
            flops = cost.sequence_flops(step.lengths, step.labels)
            kv = cost.kv_bytes(np.asarray(step.lengths, dtype=np.float64)).tolist()
            plan, world = step.plan, step.plan.dp_size * step.plan.cp_size
            clocks = [SubgroupClock(cost, plan.cp_size, world, dp) for dp in range(plan.dp_size)]
            for m, seconds in enumerate(timing.micro_batch_s[:plan.num_micro_batches]):
                if not np.isfinite(seconds) or seconds <= 0:
                    continue
                terms = [t for dp in range(plan.dp_size) for t in
                         rank_terms(plan.micro_batches[dp][m], flops, kv, clocks[dp], cost.num_layers)]
                self.ranks.append(terms)
                self.seconds.append(float(seconds))

    def rows(self, theta: np.ndarray, overlap: float) -> np.ndarray:
        """Each micro-batch's row at its critical rank under theta."""
        return np.array([_row(max(terms, key=lambda r: _time(r, theta, overlap)), overlap)
                         for terms in self.ranks])

    def predicted(self, theta: np.ndarray, overlap: float) -> np.ndarray:
        return np.array([max(_time(r, theta, overlap) for r in terms) for terms in self.ranks])


def refit(cost: CostModel, planned: dict[int, PlannedStep], timings: Sequence[StepTiming], *,
          world: int, min_steps: int = 2) -> Refit | None:
    """Fit the profile's time terms to `timings` of steps `planned` under `cost` (module docstring).

    `world`: the ranks the optimizer's state is split over (optimizer_s_per_param). None when the window
    holds too little: fewer than `min_steps` usable steps, or not one micro-batch more than the terms it
    exercises (the ring's two only where something was sharded).
    """
    usable = [t for t in timings if not t.first_of_session and t.step in planned]
    if len(usable) < min_steps:
        return None
    observed = _Observations(planned, usable, cost)
    p = cost.profile
    overlap = p.ring_overlap
    prior = np.array([1.0, 1.0, cost.micro_batch_overhead_s(world), p.ring_sequence_step_s])
    rows = observed.rows(prior, overlap)
    exercised = int(np.count_nonzero(np.any(rows != 0, axis=0))) if len(rows) else 0
    if len(rows) <= exercised:
        return None
    seconds = np.asarray(observed.seconds)
    theta = prior.copy()
    before = _median_error(observed.predicted(prior, overlap), seconds)
    for _ in range(_ROUNDS):
        theta = _robust_fit(observed.rows(theta, overlap), seconds, prior)
    after = _median_error(observed.predicted(theta, overlap), seconds)
    optimizer = _optimizer_s_per_param(usable, cost, world)
    profile = fitted_profile(p, theta, cost.micro_batch_overhead_s(world), optimizer, world=world,
                             params=cost.params)
    return Refit(profile=profile, factors=dict(zip(TERMS, theta.tolist(), strict=True)),
                 steps=tuple(sorted({t.step for t in usable})), micro_batches=len(seconds),
                 error_before=before, error_after=after)


def _median_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.median(np.abs(predicted - measured) / measured))


def _robust_fit(rows: np.ndarray, seconds: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """The MAP fit (module docstring): Huber-IRLS relative least squares whose residuals are measured in
    units of the window's own noise (sigma, re-estimated each round), against the prior (`_prior_rows`)."""
    hubers = np.ones(len(seconds))
    sigma = MIN_NOISE
    theta = prior.copy()
    for _ in range(_IRLS):
        prior_rows, prior_targets = _prior_rows(rows, seconds, prior, scale=float(theta[0]))
        theta = _bounded_least_squares(rows, seconds, hubers / (seconds * sigma), prior_rows, prior_targets,
                                       start=prior)
        residual = np.abs(rows @ theta - seconds) / seconds
        sigma = max(MIN_NOISE, 1.4826 * float(np.median(residual)))  # the MAD's normal-equivalent
        delta = 1.5 * sigma
        hubers = np.where(residual <= delta, 1.0, delta / np.maximum(residual, 1e-12))
        hubers[residual > 5 * delta] = 0.0
    return theta


def _prior_rows(rows: np.ndarray, seconds: np.ndarray, prior: np.ndarray, *,
                scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The prior as weighted linear rows (P, p): sum_k (P_k theta - p_k)^2 joins the least squares.

    A profile from another machine, or an assumed one, is first of all off by one factor for everything
    (a slower CPU, another GPU's clock), so the prior says: the compute factor is 1 give or take
    PRIOR_SPREAD, and every other term is its anchor value times the *compute factor*, give or take its
    spread (the ring factor: PRIOR_SPREAD; the micro-batch overhead: PRIOR_SPREAD of its value or a tenth
    of the median micro-batch, whichever is larger, since a profile may have it near 0; a sharded
    sequence's step: its value or a tenth of the median micro-batch per step), each spread times `scale`,
    the compute factor of the previous solve (a term 5x smaller is known to 1/5 the seconds). Where the
    window cannot tell two terms apart (micro-batches all packed alike: compute against overhead) the
    terms then move together and the data split only what they show: from a profile whose every time term
    is 3x off the fit lands on the machine, where a prior centred on the anchor's own overhead would hold
    the overhead 3x off and bias every prediction. A term the window never exercises (no sharded
    micro-batch) keeps its anchor value.
    """
    typical_t = float(np.median(seconds))
    steps = rows[:, 3][rows[:, 3] > 0]
    step_spread = max(prior[3] * scale, 0.1 * typical_t / float(np.median(steps))) if len(steps) else 0.0
    spread = np.array([PRIOR_SPREAD * prior[0], PRIOR_SPREAD * prior[1] * scale,
                       max(PRIOR_SPREAD * prior[2] * scale, 0.1 * typical_t), step_spread])
    exercised = np.any(rows != 0, axis=0) & (spread > 0)
    p_rows = np.eye(len(prior))
    p_rows[1:, 0] = np.where(exercised[1:], -prior[1:], 0.0)  # term_k - anchor_k * compute factor
    targets = np.where(exercised, 0.0, prior)
    targets[0] = prior[0]
    pinned = 1e9 / np.maximum(np.abs(prior), 1.0)
    weights = np.where(exercised, 1.0 / np.where(spread > 0, spread, 1.0), pinned)
    return p_rows * weights[:, None], targets * weights


def _bounded_least_squares(rows: np.ndarray, seconds: np.ndarray, weights: np.ndarray, prior_rows: np.ndarray,
                           prior_targets: np.ndarray, *, start: np.ndarray) -> np.ndarray:
    """min sum (w_i (x_i theta - t_i))^2 + |P theta - p|^2 over _LOWER <= theta <= _UPPER: a term that
    leaves its bounds is fixed there and the rest solved again."""
    fixed = np.zeros(len(start), dtype=bool)
    theta = start.copy()
    a_all = np.vstack([rows * weights[:, None], prior_rows])
    b_all = np.concatenate([seconds * weights, prior_targets])
    for _ in range(len(start) + 1):
        free = ~fixed
        target = b_all - a_all[:, fixed] @ theta[fixed]
        theta[free] = np.linalg.lstsq(a_all[:, free], target, rcond=None)[0]
        low, high = free & (theta < _LOWER), free & (theta > _UPPER)
        if not (low.any() or high.any()):
            return theta
        theta[low], theta[high] = _LOWER[low], _UPPER[high]
        fixed |= low | high
    return theta


def _optimizer_s_per_param(timings: Sequence[StepTiming], cost: CostModel, world: int) -> float | None:
    measured = [t.optimizer_s for t in timings if np.isfinite(t.optimizer_s) and t.optimizer_s > 0]
    if not measured or cost.params <= 0:
        return None
    return float(np.median(measured)) * max(world, 1) / cost.params


def fitted_profile(profile: HardwareProfile, theta: np.ndarray, overhead_now: float,
                   optimizer_s_per_param: float | None, *, world: int, params: int) -> HardwareProfile:
    """The profile with the fitted terms written back (module docstring)."""
    compute, ring, overhead, sequence_s = (float(x) for x in theta)
    launch = profile.micro_batch_launch_s + (overhead - overhead_now)
    changes: dict[str, float] = {
        "mfu": profile.mfu / compute,
        "intra_node_latency_s": profile.intra_node_latency_s * ring,
        "inter_node_latency_s": profile.inter_node_latency_s * ring,
        "intra_node_comm_offset_s": profile.intra_node_comm_offset_s * ring,
        "inter_node_comm_offset_s": profile.inter_node_comm_offset_s * ring,
        "intra_node_bandwidth": profile.intra_node_bandwidth / ring,
        "inter_node_bandwidth": profile.inter_node_bandwidth / ring,
        "micro_batch_launch_s": max(launch, 0.0),
        "ring_sequence_step_s": sequence_s,
    }
    collective_s = overhead_now - profile.micro_batch_launch_s
    if launch < 0 and collective_s > 0 and world > 1:
        # b below the collective alone: the gradient reduction itself is faster than the profile says
        speedup = collective_s / max(overhead, 1e-12)
        changes["grad_reduce_bandwidth"] = profile.collective_bandwidth(world) * speedup
    if optimizer_s_per_param is not None:
        changes["optimizer_s_per_param"] = optimizer_s_per_param
    return dataclasses.replace(profile, **changes)
