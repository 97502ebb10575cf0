"""The dry run behind `python -m app plan`: sample global batches, plan them with every policy, model them.

Everything printed is *modeled* (scheduling.simulate under a hardware profile), never measured, except the
planning latency, which is the wall time of `plan_step` on this machine. Before planning, the sampled lengths
go through data.too_long (error | truncate | drop) at the run's maximum sequence length; the report says how
many sequences that changed (TooLongReport).

Bound ratios (see scheduling/simulate.py for the bounds and their proofs), the headline one first:
    bound_ratio_feasible sum of step / sum of max(perfect balance, the longest sequence alone on its CP
                         group): what a plan leaves on the table that some plan might still recover
                         (table column "bound")
    bound_ratio          sum over batches of step / sum of the perfect-balance bound (all FLOPs spread over
                         all ranks, no communication), which no plan keeping a sequence inside one CP group
                         can reach when one sequence outweighs a CP group's share ("perfect bal")
    bound_ratio_median   the median of the per-batch step / perfect-balance bound ("p. bal p50")
The bounds allow every CP degree of scheduling.cp_degrees (scheduling.simulate.lower_bounds), the same for
every policy.

Per-sequence CP degrees (docs/design.md §13): skrull plans with scheduling.cp_degrees and dynamic_cp uses
them as its degree set. When they go beyond [1, N], skrull is planned a second time at [1, N] (the paper's
two-level DACP) and `degree_summary` reports the modeled speedup of the configured degrees over it
("speedup_all_degrees_vs_two_level") and over dynamic_cp ("speedup_vs_dynamic_cp"): `plan --json`'s
"cp_degrees" object, and one line under the table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.config import ConfigError, SkrullConfig
from scheduling import POLICIES, CostModel, SchedulingError, StepEstimate, plan_step, sample_lengths, simulate
from scheduling.dacp_degrees import is_two_level

COLUMNS = (
    ("policy", "{}"), ("modeled_step_s", "{:.4f}"), ("speedup_vs_balanced_packed", "{:.2f}x"),
    ("speedup_vs_static_cp", "{:.2f}x"),
    ("speedup_vs_static_cp_packed", "{:.2f}x"), ("speedup_vs_sorted", "{:.2f}x"),
    ("bound_ratio_feasible", "{:.3f}"), ("bound_ratio", "{:.3f}"), ("bound_ratio_median", "{:.3f}"),
    ("dp_imbalance", "{:.3f}"), ("cp_imbalance", "{:.3f}"), ("distributed_token_fraction", "{:.3f}"),
    ("micro_batches", "{:.1f}"), ("plan_ms_median", "{:.2f}"), ("plan_ms_p99", "{:.2f}"),
)
HEADERS = ("policy", "step s", "vs balanced", "vs static", "vs packed", "vs sorted", "bound", "perfect bal",
           "p. bal p50",
           "DP imb", "CP imb",
           "dist frac", "mb/rank", "plan ms p50", "plan ms p99")


@dataclass(frozen=True)
class TooLongReport:
    """What data.too_long did to the sampled sequences: `rows` of `sampled` were truncated or dropped."""

    mode: str
    rows: int
    limit: int
    sampled: int
    truncate_side: str = "left"

    def as_json(self) -> dict[str, int | str]:
        return {"mode": self.mode, "rows": self.rows, "limit": self.limit, "sampled": self.sampled}

    def line(self) -> str | None:
        """One line for the plan's text output; None for data.too_long=error (it changed nothing)."""
        if self.mode == "truncate":
            return (f"data.too_long=truncate: {self.rows} of {self.sampled} sampled sequences cut to "
                    f"{self.limit} tokens (data.truncate_side={self.truncate_side})")
        if self.mode == "drop":
            return (f"data.too_long=drop: {self.rows} of {self.sampled} sampled sequences dropped (longer "
                    f"than {self.limit} tokens)")
        return None


def apply_too_long(lengths: np.ndarray, config: SkrullConfig) -> tuple[np.ndarray, int]:
    """Enforce data.max_length (default C*N) the way data.too_long says: error | truncate | drop.

    Returns (lengths after the rule, rows it changed: truncated or dropped). The plan only sees lengths:
    a row that truncation would leave without a label token (status truncated_empty in a run) is still
    planned here at the limit.
    """
    limit = config.max_sequence_length
    over = lengths > limit
    changed = int(over.sum())
    if not changed:
        return lengths, 0
    mode = config.data.too_long
    if mode == "truncate":
        return np.minimum(lengths, limit), changed
    if mode == "drop":
        return lengths[~over], changed
    raise ConfigError(
        f"{int(over.sum())} sequence(s) longer than {limit} tokens (longest {int(lengths.max())}); the limit "
        "is data.max_length or scheduling.bucket_size * parallel.cp_size: raise them, or set "
        "data.too_long=truncate|drop"
    )


def sample_batches(config: SkrullConfig) -> tuple[list[np.ndarray], TooLongReport]:
    """plan.num_batches global batches of scheduling.global_batch_size lengths from the data source."""
    batches, report, _ = sample_batches_with_data(config)
    return batches, report


def sample_batches_with_data(config: SkrullConfig) -> tuple[list[np.ndarray], TooLongReport, dict[str, Any]]:
    """sample_batches, plus what the rows read were ({"rows", "usable_rows", "formats", "malformed"}:
    app/data/lengths.py LocalScan, `plan --json`'s "data").

    Also returns what data.too_long did to the sampled sequences. The synthetic source draws twice the
    sequences needed so that too_long=drop still fills the batches; with truncate only the planned ones
    are kept, so the report counts exactly the sequences the plan uses.
    """
    num, size = config.plan.num_batches, config.scheduling.global_batch_size
    data = config.data
    if not data.synthetic:
        from app.data.lengths import scan_local  # another component; only needed for real data

        scan = scan_local(data, limit=num * size, max_length=config.max_sequence_length)
        lengths, read = np.asarray(scan.lengths, dtype=np.int64), scan.as_json()
    else:
        raw = sample_lengths(data.distribution, 2 * num * size, data.seed)  # spare rows for too_long=drop
        lengths = np.maximum(1, np.round(raw * data.length_scale)).astype(np.int64)
        if data.too_long == "truncate":
            lengths = lengths[: num * size]
        read = {"rows": len(lengths), "usable_rows": len(lengths), "formats": {"synthetic": len(lengths)},
                "malformed": None}
    sampled = len(lengths)
    lengths, changed = apply_too_long(lengths, config)
    report = TooLongReport(mode=data.too_long, rows=changed, limit=config.max_sequence_length,
                           sampled=sampled, truncate_side=data.truncate_side)
    if len(lengths) < size:
        raise ConfigError(
            f"the data source gave {len(lengths)} sequences, fewer than scheduling.global_batch_size={size}"
            + (f" ({changed} of {sampled} dropped by data.too_long=drop)" if data.too_long == "drop" else "")
        )
    count = min(num, len(lengths) // size)
    return [lengths[b * size:(b + 1) * size] for b in range(count)], report, read


@dataclass
class PolicyRun:
    """Estimates and planning latencies of one policy over the sampled batches."""

    estimates: list[StepEstimate] = field(default_factory=list)
    plan_ms: list[float] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return sum(e.step_s for e in self.estimates)


def run_policies(config: SkrullConfig, cost: CostModel, batches: list[np.ndarray],
                 policies: tuple[str, ...] = POLICIES,
                 cp_degrees: tuple[int, ...] | None = None) -> dict[str, PolicyRun]:
    """Plan and model every batch with every policy, at `cp_degrees` (None: the config's)."""
    par, sched = config.parallel, config.scheduling
    degrees = config.cp_degrees if cp_degrees is None else cp_degrees
    bound_degrees = config.cp_degrees  # one bound for every run: the plans the config allows
    runs = {p: PolicyRun() for p in policies}
    for batch in batches:
        for policy in policies:
            start = time.perf_counter()
            step = plan_step(policy, batch, dp_size=par.dp_size, cp_size=par.cp_size,
                             bucket_size=sched.bucket_size, cost=cost, seed=sched.seed,
                             static_cp_micro_batch=sched.static_cp_micro_batch, cp_degrees=degrees,
                             chunkflow_keep=sched.chunkflow_keep, baselines=sched.calibration == "online")
            runs[policy].plan_ms.append((time.perf_counter() - start) * 1e3)
            runs[policy].estimates.append(simulate(step, batch, cost, cp_degrees=bound_degrees))
    return runs


def degree_summary(config: SkrullConfig, runs: dict[str, PolicyRun], two_level: PolicyRun) -> dict[str, Any]:
    """The configured CP degrees against [1, N] (skrull planned there: `two_level`) and dynamic_cp."""
    skrull = runs["skrull"].total_s
    return {
        "cp_degrees": list(config.cp_degrees),
        "modeled_step_s": skrull / len(runs["skrull"].estimates),
        "two_level_modeled_step_s": two_level.total_s / len(two_level.estimates),
        "dynamic_cp_modeled_step_s": runs["dynamic_cp"].total_s / len(runs["dynamic_cp"].estimates),
        "speedup_all_degrees_vs_two_level": two_level.total_s / skrull,
        "speedup_vs_dynamic_cp": runs["dynamic_cp"].total_s / skrull,
        "speedup_vs_balanced_packed": runs["balanced_packed"].total_s / skrull,
        "two_level_plan_ms_median": float(np.median(two_level.plan_ms)),
    }


def degree_line(degrees: dict[str, Any]) -> str:
    """One line for the plan's text output."""
    return (f"cp_degrees={degrees['cp_degrees']}: skrull {degrees['modeled_step_s']:.4f} s, "
            f"{degrees['speedup_all_degrees_vs_two_level']:.3f}x over [1, N] (two-level DACP, "
            f"{degrees['two_level_modeled_step_s']:.4f} s), {degrees['speedup_vs_dynamic_cp']:.3f}x over "
            f"dynamic_cp ({degrees['dynamic_cp_modeled_step_s']:.4f} s) (modeled)")


def summarize(runs: dict[str, PolicyRun]) -> dict[str, dict[str, float]]:
    """Per policy: the JSON row (speedups are ratios of total modeled time over all batches)."""
    out = {}
    for policy, run in runs.items():
        est = run.estimates
        out[policy] = {
            "modeled_step_s": run.total_s / len(est),
            "speedup_vs_balanced_packed": runs["balanced_packed"].total_s / run.total_s,
            "speedup_vs_static_cp": runs["static_cp"].total_s / run.total_s,
            "speedup_vs_static_cp_packed": runs["static_cp_packed"].total_s / run.total_s,
            "speedup_vs_sorted": runs["sorted"].total_s / run.total_s,
            "bound_ratio": run.total_s / sum(e.bound_s for e in est),
            "bound_ratio_median": float(np.median([e.bound_ratio for e in est])),
            "bound_ratio_feasible": run.total_s / sum(e.feasible_bound_s for e in est),
            "dp_imbalance": float(np.mean([e.dp_imbalance for e in est])),
            "cp_imbalance": float(np.mean([e.cp_imbalance for e in est])),
            "distributed_token_fraction": float(np.mean([e.distributed_token_fraction for e in est])),
            "micro_batches": float(np.mean([e.num_micro_batches for e in est])),
            "plan_ms_median": float(np.median(run.plan_ms)),
            "plan_ms_p99": float(np.percentile(run.plan_ms, 99)),
        }
    return out


def format_table(summary: dict[str, dict[str, float]]) -> str:
    rows = [HEADERS] + [
        tuple(fmt.format(policy if key == "policy" else row[key]) for key, fmt in COLUMNS)
        for policy, row in summary.items()
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(HEADERS))]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w)
                       for c, (cell, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def plot_ranks(runs: dict[str, PolicyRun], path: str) -> None:
    """Bar chart of the first batch's modeled busy time per (DP, CP) rank: static CP beside Skrull."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, policy in zip(axes, ("static_cp", "skrull"), strict=True):
        est = runs[policy].estimates[0]
        busy = [t for dp in est.rank_busy_s for t in dp]
        ax.bar(range(len(busy)), busy, color="tab:gray" if policy == "static_cp" else "tab:blue")
        ax.axhline(est.step_s, color="tab:red", linestyle="--", label=f"step {est.step_s:.3f} s")
        ax.set_title(f"{policy}: modeled busy time per rank (batch 0)")
        ax.set_xlabel("rank (dp * cp_size + cp)")
        ax.legend()
    axes[0].set_ylabel("seconds (modeled)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plan_dry_run(config: SkrullConfig, cost: CostModel) -> tuple[dict[str, PolicyRun], dict, TooLongReport,
                                                                 dict[str, Any], dict[str, Any]]:
    """Sample, plan and model; SchedulingError becomes a ConfigError (it names the knob already).

    Returns the runs, their summary, what data.too_long did, what the rows read were, and the CP degrees'
    summary (degree_summary)."""
    batches, too_long, read = sample_batches_with_data(config)
    try:
        runs = run_policies(config, cost, batches)
        n = config.parallel.cp_size
        two_level = runs["skrull"] if is_two_level(config.cp_degrees, n) else run_policies(
            config, cost, batches, ("skrull",), tuple(sorted({1, n})))["skrull"]
    except SchedulingError as err:
        raise ConfigError(str(err)) from None
    return runs, summarize(runs), too_long, read, degree_summary(config, runs, two_level)
