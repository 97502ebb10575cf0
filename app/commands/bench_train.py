"""`python -m app bench train`: measured step time of scheduling policies on the same global batches.

    python -m app bench train --config configs/bench/cpu-lmsys.yaml
        [--policies skrull,balanced_packed,static_cp_packed,static_cp,sorted,chunkflow] [--steps 16]
        [--calibration online|off] [--json] [--plot out.png]
        [--set key=value ...] [--no-progress] [--verbose]

One Ray session and one worker group train every policy, interleaved step by step (A B C D, B C D A, ...:
the order rotates each step, so no policy always runs first) after one warm-up step each, from identical
weights on identical global batches (app/bench/driver.py, workers/bench_loop.py). With --calibration
online (the default config's) each policy's planner refits its profile from that policy's own steps only,
as a run of that policy would (scheduling/refit.py; so no policy plans with what another one measured),
and the counted steps start after scheduling.calibration_window more uncounted steps, over which skrull
also runs its candidate plans in turn. Per policy, over the counted steps:

    step_s_median          median of step_s = max over ranks of (planner wait + compute), as `train` reports
    step_cpu_s_median      median of the step's largest per-rank CPU time (the work, without the waiting)
    tokens_per_s           median global tokens of a step / step_s_median (all policies train the same
                           batches, so ratios of tokens_per_s are the speedups)
    predicted_step_s       median of the cost model's step time of the same plans (scheduling/simulate.py)
    prediction_error       predicted_step_s / step_s_median - 1
    prediction_error_before_calibration   the same with the starting profile's predictions of the same plans
    prediction_abs_error_median           median over the steps of |predicted - measured| / measured
    prediction_abs_error_median_before_calibration   the same with the starting profile's predictions
    prediction_abs_error_median_net_of_drift         the same with the machine's drift divided out
                           (app/bench/drift.py: the error relative to the other policies' at the same
                           step; null with fewer than 3 policies)
    calibration_version    how many times the policy's planner had refitted by its last counted step
    speedup_vs_<baseline>  the baseline's step_s_median / this policy's; null when it was not run
    paired_speedup_vs_<baseline>  median over steps of the baseline's step_s / this policy's on the same batch
    planner_wait_s_median  median of a step's longest planner wait
    compute_imbalance      median over steps of max / mean compute time over ranks (train's metric)
    cpu_imbalance          the same over CPU time, which leaves out the time a rank sat blocked in a
                           collective waiting for a peer (compute time does not)
    busy_s_per_rank, cpu_s_per_rank, predicted_busy_s_per_rank     per-rank medians over the steps
    per_step               step, step_s, predicted_step_s, loss, tokens and sorted sample ids of each step

Top level: `same_samples` (every policy trained the same sample ids at every step), `loss_max_rel_diff`
(the largest relative loss difference from the first policy at any step), `machine_drift` (per counted
step, the median over the policies of measured / predicted: what the machine did to all of them at once,
app/bench/drift.py; null with fewer than 3 policies), `calibration` (online | off),
`warmup_steps` (the uncounted steps), `stale_profile_warning` (the warning of app/profiling/stale_check.py
when the profile's predictions are off by more than 30%, else null; also printed),
`distinct_global_batches` (global batches of distinct samples in one epoch of the data),
`repeated_samples_warning` (when the steps, warm-up included, outnumber them, so later steps revisit
samples; else null; also printed), `wall_s`, `machine` (cores, load average at start and end), `run_dir`
(the log and bench_train.json, a copy of the --json line).
Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from app.bench.summary import BASELINES, summarize
from app.commands.common import add_config_arguments, add_json_argument, config_from_args
from app.config import ConfigError
from app.rundir.files import jsonable

DEFAULT_POLICIES = "skrull,balanced_packed,static_cp_packed,static_cp,sorted,chunkflow"
_WARNINGS = ("stale_profile_warning", "repeated_samples_warning")
"""The summary's warnings: printed after the report, or to stderr beside the --json line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, required=True)
    add_json_argument(parser)
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help=f"comma-separated scheduling policies to compare (default {DEFAULT_POLICIES})")
    # 16: single step pairs on a 2-core VM scatter +-10% (docs/benchmarks.md), so a paired median of 8
    # cannot resolve the 3% that separates packing policies planning nearly the same micro-batches
    parser.add_argument("--steps", type=int, default=16,
                        help="counted steps per policy, after 1 warm-up (and the calibration window)")
    parser.add_argument("--calibration", choices=("online", "off"), default=None,
                        help="scheduling.calibration for every policy (default: the config's): online "
                             "refits each policy's profile from its own steps, and the counted steps start "
                             "after scheduling.calibration_window more steps")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="write per-rank busy time (static_cp_packed beside skrull) and predicted vs "
                             "measured step time to this image")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--verbose", action="store_true",
                        help="show Ray's, DeepSpeed's and the workers' own output on the terminal "
                             "(by default it goes to <run_dir>/logs/driver.log)")


def check_plot_path(path: str) -> None:
    """--plot must name a writable directory's file of a format matplotlib writes (checked before running)."""
    from matplotlib.figure import Figure

    target = Path(path)
    formats = Figure().canvas.get_supported_filetypes()
    if target.suffix.lstrip(".").lower() not in formats:
        raise ConfigError(f"--plot={path!r}: the file name must end in one of "
                          f"{', '.join('.' + f for f in sorted(formats))}")
    folder = target.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(f"--plot={path!r}: {str(folder)!r} is not a writable directory")


def run(args: argparse.Namespace) -> int:
    from app.bench.driver import bench_train, check_policies

    policies = check_policies(args.policies.split(","))
    if args.plot:
        check_plot_path(args.plot)
    if args.calibration is not None:
        # quoted: --set values are YAML, where a bare `off` is the boolean false
        args.overrides = [*args.overrides, f'scheduling.calibration="{args.calibration}"']
    config = config_from_args(args)
    try:
        result = bench_train(config, policies, args.steps, progress=not (args.no_progress or args.json),
                             quiet=not args.verbose)
    except KeyboardInterrupt:
        print("\ninterrupted: Ray is shut down; nothing was measured", file=sys.stderr, flush=True)
        return 130
    summary = summarize(result)
    line = json.dumps(jsonable(summary))
    _write_atomically(Path(result.run_dir) / "bench_train.json", line + "\n")
    if args.plot:
        plot_bench(summary, args.plot)
    if args.json:
        print(line)
        for warning in _WARNINGS:
            if summary[warning]:
                print(summary[warning], file=sys.stderr)
    else:
        print(format_report(summary, plot=args.plot))
    return 0


# -------------------------------------------------------------------------------------------- output

COLUMNS = (
    ("step s p50", "step_s_median", "{:.3f}"), ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("pred s", "predicted_step_s", "{:.3f}"), ("pred err", "prediction_error", "{:+.0%}"),
    ("vs balanced", "speedup_vs_balanced_packed", "{:.2f}x"),
    ("vs packed", "speedup_vs_static_cp_packed", "{:.2f}x"), ("vs static", "speedup_vs_static_cp", "{:.2f}x"),
    ("vs sorted", "speedup_vs_sorted", "{:.2f}x"), ("wait s p50", "planner_wait_s_median", "{:.3f}"),
    ("compute imb", "compute_imbalance", "{:.2f}"), ("cpu imb", "cpu_imbalance", "{:.2f}"),
    ("mb/step", "micro_batches_median", "{:g}"),
)


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """One row per policy; '-' where a value does not exist (a baseline that was not run)."""
    table = [("policy", *(header for header, _, _ in COLUMNS))]
    for policy, row in rows.items():
        cells = ("-" if row[key] is None else fmt.format(row[key]) for _, key, fmt in COLUMNS)
        table.append((policy, *cells))
    widths = [max(len(line[c]) for line in table) for c in range(len(table[0]))]
    lines = [_aligned(line, widths) for line in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _aligned(cells: tuple[str, ...], widths: list[int]) -> str:
    """The first cell left-aligned, the numbers right-aligned."""
    (first, width), *rest = zip(cells, widths, strict=True)
    return "  ".join([first.ljust(width), *(cell.rjust(w) for cell, w in rest)])


def _ratio(row: dict[str, Any], baseline: str) -> str:
    return (f"{row[f'speedup_vs_{baseline}']:.2f}x vs {baseline} (per-step pairs: "
            f"{row[f'paired_speedup_vs_{baseline}']:.2f}x)")


def format_report(summary: dict[str, Any], plot: str | None = None) -> str:
    rows, machine = summary["policies"], summary["machine"]
    load = " ".join(f"{x:g}" for x in machine["load_avg_1_5_15_min"])
    lines = [
        f"bench train: {', '.join(rows)} interleaved, {summary['steps']} counted steps each (+"
        f"{summary['warmup_steps']} warm-up), DP {summary['dp_size']} x CP {summary['cp_size']}, BucketSize "
        f"{summary['bucket_size']}, {summary['global_batch_size']} sequences per step",
        f"wall {summary['wall_s']:.0f} s on {machine['cpus']} CPUs, load average at start {load} (measured "
        "times; 'pred' is the cost model's time of the same plans)",
        "",
        format_table(rows),
        "",
    ]
    for policy, row in rows.items():
        ratios = [_ratio(row, b) for b in BASELINES if b != policy and row[f"speedup_vs_{b}"] is not None]
        if policy not in BASELINES and ratios:
            lines.append(f"{policy}: {', '.join(ratios)}")
    if summary.get("machine_drift"):
        lines.append(_drift_line(summary["machine_drift"], rows))
    same = "yes" if summary["same_samples"] else "NO"
    lines.append(f"same samples every step: {same}; losses agree within {summary['loss_max_rel_diff']:.1e} "
                 "relative")
    lines.append(f"run directory: {summary['run_dir']} (bench_train.json, logs/driver.log)")
    lines += [summary[w] for w in _WARNINGS if summary.get(w)]
    if plot:
        lines.append(f"plot written to {plot}")
    return "\n".join(lines)


def _drift_line(drift: list[float], rows: dict[str, dict[str, Any]]) -> str:
    net = ", ".join(f"{p} {row['prediction_abs_error_median_net_of_drift']:.0%}" for p, row in rows.items()
                    if row.get("prediction_abs_error_median_net_of_drift") is not None)
    return (f"machine drift (measured / predicted, moving every policy together): {min(drift) - 1:+.0%} to "
            f"{max(drift) - 1:+.0%} over the counted steps; prediction error without it: {net}")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(3)}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- plot


def plot_bench(summary: dict[str, Any], path: str) -> None:
    """Left: per-rank busy time, balanced_packed beside skrull; right: predicted vs measured step time.

    Written to a temporary file first and renamed, so a failure never leaves a half-written image.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["policies"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5))
    _plot_busy(left, rows)
    _plot_steps(right, rows)
    fig.tight_layout()
    target = Path(path)
    tmp = target.with_name(f".{target.stem}.{secrets.token_hex(3)}{target.suffix}")
    try:
        fig.savefig(tmp)
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _plot_busy(ax: Any, rows: dict[str, dict[str, Any]]) -> None:
    """Per policy and rank: median compute (wall), CPU time and the cost model's busy time."""
    shown = [p for p in ("balanced_packed", "skrull") if p in rows] or list(rows)[:2]
    bars = (("busy_s_per_rank", "compute (wall)", {}), ("cpu_s_per_rank", "CPU time", {"alpha": 0.5}),
            ("predicted_busy_s_per_rank", "modeled busy", {"fill": False, "hatch": "//"}))
    ticks, labels = [], []
    for group, policy in enumerate(shown):
        ranks = len(rows[policy]["busy_s_per_rank"])
        for rank in range(ranks):
            x = group * (ranks + 1) + rank
            ticks.append(x)
            labels.append(f"{policy}\nrank {rank}")
            for k, (key, label, style) in enumerate(bars):
                value = rows[policy][key][rank]
                ax.bar(x + (k - 1) * 0.27, value or 0.0, width=0.27, color=f"C{k}", edgecolor=f"C{k}",
                       label=label if (group, rank) == (0, 0) else None, **style)
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("seconds per step (median)")
    ax.set_title("per-rank busy time: measured vs modeled")
    ax.legend()


def _plot_steps(ax: Any, rows: dict[str, dict[str, Any]]) -> None:
    """Every counted step of every policy: measured step_s (solid) and predicted (dashed)."""
    values = []
    for index, (policy, row) in enumerate(rows.items()):
        steps = row["per_step"]
        predicted = [math.nan if v is None else v for v in steps["predicted_step_s"]]
        ax.plot(steps["step"], steps["step_s"], "o-", color=f"C{index}", label=f"{policy} measured")
        ax.plot(steps["step"], predicted, "x--", color=f"C{index}", label=f"{policy} predicted")
        values += [v for v in steps["step_s"] + predicted if v > 0]
    if values and max(values) / min(values) > 20:  # a far-off prediction would flatten the measured lines
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_title("predicted vs measured step time")
    ax.legend(fontsize=7, ncol=2)
