"""`report RUN_DIR`: a finished or running run in one screen, from its run directory alone.

Reads what the driver persists as the run goes (app/rundir/files.py): metrics.jsonl (every reported step),
worker_starts.jsonl, data_summary.json and the config snapshot. A step reported twice (a restarted
worker group re-trains the steps after its checkpoint) counts once, with its last record, as in the
`train` summary; so `history` equals `train`'s TrainSummary.history (NaN written as null).

`run_report` returns the stable dict `report --json` prints:

    run_dir, name, status ("finished" | "stopped" | "running or stopped" | "no step yet"), last_step,
    total_steps, steps, samples, tokens, loss_first, loss_last (the last step's; null when it was
    non-finite), loss_min, eval_loss_last, lr_first, lr_last, lr_max (the learning rate each step
    trained with, as the optimizer held it),
    nonfinite_steps (steps whose loss or gradient norm was inf/NaN: their updates were not applied),
    loss_spikes ([{step, loss, median}]: a loss above LOSS_SPIKE_FACTOR x the median of the previous
    SPIKE_WINDOW finite losses; not an error, often the start of a divergence),
    stopped (why the run stopped early, as `train` said it: a non-finite step, a full disk; or null),
    tokens_per_s (all tokens / all step time, as `train` prints it), tokens_per_s_median,
    tokens_per_s_per_worker_median, step_s_median, mfu_median, padding_fraction_mean,
    predicted_step_s_median (the hardware profile's time of the steps' plans), profile_ratio (median of
    predicted / measured step time over the first steps: app/profiling/stale_check.py; off by more than 30%,
    the profile is stale),
    compute_imbalance_median, compute_imbalance_max,
    planner_ahead_steps_median, planner_ahead_steps_min, planner_wait_s_median, plan_ms_median,
    starts (worker-group starts), restarts (starts beyond the first of each `train` call: failures and
    elastic resizes), resumes (`train` calls beyond the first),
    start_ups ([{step, engine_s, warmup_s}] of every start that reported a step, in order: the engine
    built and the checkpoint loaded, then the warm-up micro-batch; runs from before these were recorded:
    []),
    rank_compute_s_mean (per world rank, over the steps of the newest group shape; null: a spare rank),
    calibration (scheduling.calibration=online: {fits, steps, factors, profile} of the newest fit and
    step_error_first / step_error_last, the median |predicted - measured| / measured over the first and
    the last steps; null without a fit: app/profiling/calibration_log.py),
    data (data_summary.json, or null), history (every step's record, in step order)

Missing metrics (a run from before a metric existed) give null, never an error.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app.config import ConfigError
from app.profiling.calibration_log import calibration_summary, describe_factors
from app.profiling.stale_check import STALE_STEPS, STALE_TOLERANCE, median_ratio
from app.rundir.files import is_run_dir, read_run
from app.sinks.tensorboard import scalars

SPARK = "▁▂▃▄▅▆▇█"
LOSS_SPIKE_FACTOR = 10.0
SPIKE_WINDOW = 100
"""The running median of a loss spike covers this many previous finite losses (a long run's early losses
would otherwise keep the median high long after the loss fell)."""


def _values(history: list[dict[str, Any]], key: str) -> list[float]:
    return [float(h[key]) for h in history if isinstance(h.get(key), int | float)]


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return float(statistics.median(values)) if values else None


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return float(statistics.fmean(values)) if values else None


def step_history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last record of every step, in step order (a restarted group's re-trained steps replace)."""
    return sorted({int(r["step"]): r for r in records}.values(), key=lambda r: int(r["step"]))


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def nonfinite_steps(history: list[dict[str, Any]]) -> list[int]:
    """Steps whose update was skipped or whose loss was inf/NaN (written as null, app/rundir/files.py)."""
    return [int(h["step"]) for h in history if h.get("update_skipped") or not _finite(h.get("loss"))]


def loss_spikes(history: list[dict[str, Any]], factor: float = LOSS_SPIKE_FACTOR,
                window: int = SPIKE_WINDOW) -> list[dict[str, float]]:
    """Steps whose loss exceeds `factor` x the median of the previous `window` finite losses."""
    spikes, previous = [], []
    for h in history:
        loss = h.get("loss")
        if not _finite(loss):
            continue
        if previous:
            median = statistics.median(previous[-window:])
            if loss > factor * median > 0:
                spikes.append({"step": int(h["step"]), "loss": float(loss), "median": float(median)})
        previous.append(float(loss))
    return spikes


def rank_compute_means(history: list[dict[str, Any]]) -> list[float | None]:
    """Mean compute seconds per world rank over the newest group shape's steps (None: a spare rank)."""
    rows = [h["rank_compute_s"] for h in history if isinstance(h.get("rank_compute_s"), list)]
    if not rows:
        return []
    newest = [row for row in rows if len(row) == len(rows[-1])]
    columns = zip(*newest, strict=True)
    return [_mean(v for v in column if v is not None) for column in columns]


def _restarts(starts: list[dict[str, Any]]) -> tuple[int, int]:
    """(restarts within `train` calls, resumes = `train` calls beyond the first)."""
    calls: dict[str, int] = {}
    for start in starts:
        calls[start.get("driver", "")] = calls.get(start.get("driver", ""), 0) + 1
    return sum(n - 1 for n in calls.values()), max(len(calls) - 1, 0)


def _total_steps(run: dict[str, Any]) -> int | None:
    if run["starts"]:
        return int(run["starts"][-1]["total_steps"])
    steps = ((run["config"] or {}).get("train") or {}).get("steps")
    return int(steps) if steps else None


def run_report(run_dir: str | Path) -> dict[str, Any]:
    """The report of the run in `run_dir` (module docstring); ConfigError if it is not a run directory."""
    root = Path(run_dir)
    if not is_run_dir(root):
        raise ConfigError(f"RUN_DIR {str(root)!r} is not a run directory (no skrull_config.json): pass "
                          "<run.storage_path>/<run.name> of a `train` run")
    run = read_run(root)
    history = step_history(run["records"])
    last_step = int(history[-1]["step"]) if history else 0
    total = _total_steps(run)
    stopped = history[-1].get("stopped") if history else None
    status = "no step yet" if not history else "stopped" if stopped else (
        "finished" if total is not None and last_step >= total else "running or stopped")
    losses, step_s = _values(history, "loss"), _values(history, "step_s")
    tokens = sum(int(h.get("tokens", 0)) for h in history)
    restarts, resumes = _restarts(run["starts"])
    per_worker = [scalars(h).get("tokens_per_s_per_worker") for h in history]
    ahead, imbalance = _values(history, "planner_ahead_steps"), _values(history, "compute_imbalance")
    evals = _values(history, "eval_loss")
    return {
        "run_dir": str(root), "name": root.name, "status": status, "last_step": last_step,
        "total_steps": total, "steps": len(history),
        "samples": sum(int(h.get("samples", 0)) for h in history), "tokens": tokens,
        "loss_first": losses[0] if losses else None,
        "loss_last": float(history[-1]["loss"]) if history and _finite(history[-1].get("loss")) else None,
        "loss_min": min(losses, default=None),
        "nonfinite_steps": nonfinite_steps(history), "loss_spikes": loss_spikes(history), "stopped": stopped,
        "eval_loss_last": evals[-1] if evals else None,
        **_lr_fields(_values(history, "lr")),
        "tokens_per_s": tokens / sum(step_s) if sum(step_s) > 0 else None,
        "tokens_per_s_median": _median(_values(history, "tokens_per_s")),
        "tokens_per_s_per_worker_median": _median(v for v in per_worker if v is not None),
        "step_s_median": _median(step_s), "mfu_median": _median(_values(history, "mfu")),
        "predicted_step_s_median": _median(_values(history, "predicted_step_s")),
        "profile_ratio": median_ratio((h.get("predicted_step_s", math.nan), h.get("step_s", math.nan))
                                      for h in history[:STALE_STEPS]),
        "padding_fraction_mean": _mean(_values(history, "padding_fraction")),
        "compute_imbalance_median": _median(imbalance), "compute_imbalance_max": max(imbalance, default=None),
        "planner_ahead_steps_median": _median(ahead), "planner_ahead_steps_min": min(ahead, default=None),
        "planner_wait_s_median": _median(_values(history, "planner_wait_s")),
        "plan_ms_median": _median(_values(history, "plan_ms")),
        "starts": len(run["starts"]), "restarts": restarts, "resumes": resumes,
        "start_ups": start_ups(run["records"]),
        "rank_compute_s_mean": rank_compute_means(history), "calibration": calibration_summary(history),
        "data": run["data"], "history": history,
    }


def start_ups(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The start-up of each worker-group start: the first step it reported carries engine_s and warmup_s
    (every record, not the deduplicated history: a restart's re-trained step keeps its own start's)."""
    return [{"step": r.get("step"), "engine_s": r["engine_s"], "warmup_s": r.get("warmup_s")}
            for r in records if "engine_s" in r]


def _lr_fields(lrs: list[float]) -> dict[str, float | None]:
    return {"lr_first": lrs[0] if lrs else None, "lr_last": lrs[-1] if lrs else None,
            "lr_max": max(lrs, default=None)}


def sparkline(values: list[float], width: int = 60) -> str:
    """values as one line of block characters (the last `width` values), low to high."""
    values = values[-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[min(int((v - low) / span * len(SPARK)), len(SPARK) - 1)] for v in values)


def _fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def report_lines(report: dict[str, Any]) -> list[str]:
    """The one-screen text form of `run_report`'s dict."""
    r = report
    total = f" of {r['total_steps']}" if r["total_steps"] else ""
    lines = [f"run {r['name']}: {r['status']}, step {r['last_step']}{total}  ({r['run_dir']})"]
    if r["data"]:
        lines.append(r["data"]["line"])
    if not r["history"]:
        return [*lines, "no step reported yet"]
    losses = _values(r["history"], "loss")
    tokens_s = _values(r["history"], "tokens_per_s")
    evals = f", eval loss {_fmt(r['eval_loss_last'], '.4f')}" if r["eval_loss_last"] is not None else ""
    last = "non-finite" if r["loss_last"] is None and r["nonfinite_steps"] else _fmt(r["loss_last"], ".4f")
    lines += [
        f"steps     {r['steps']} reported, {r['samples']} samples, {r['tokens']} tokens",
        f"loss      {_fmt(r['loss_first'], '.4f')} -> {last} (min {_fmt(r['loss_min'], '.4f')}){evals}",
        f"          {sparkline(losses)}",
        *_health_lines(r),
        *_lr_lines(r),
        f"tokens/s  {_fmt(r['tokens_per_s'], '.0f')} overall, median step "
        f"{_fmt(r['tokens_per_s_median'], '.0f')} ({_fmt(r['tokens_per_s_per_worker_median'], '.0f')} per "
        f"worker), step {_fmt(r['step_s_median'])} s{_profile_note(r)}",
        f"          {sparkline(tokens_s)}",
        f"mfu       median {_fmt(r['mfu_median'])}; padding {_fmt(_pct(r['padding_fraction_mean']), '.1f')}%"
        " of computed tokens",
        f"imbalance compute max/mean over ranks: median {_fmt(r['compute_imbalance_median'])}, "
        f"max {_fmt(r['compute_imbalance_max'])}",
        f"planner   lead median {_fmt(r['planner_ahead_steps_median'], 'g')} steps "
        f"(min {_fmt(r['planner_ahead_steps_min'], 'g')}), wait median {_fmt(r['planner_wait_s_median'])} s, "
        f"plan {_fmt(r['plan_ms_median'])} ms",
        f"restarts  {r['restarts']} ({r['starts']} worker-group starts, {r['resumes']} resumes)",
        *_start_up_lines(r["start_ups"]),
    ]
    lines += _calibration_lines(r)
    busy = r["rank_compute_s_mean"]
    if busy:
        ranks = ", ".join(f"{rank}: {_fmt(s)}" for rank, s in enumerate(busy))
        lines.append(f"busy s    per rank, mean compute per step: {ranks}")
    return lines


def _start_up_lines(ups: list[dict[str, Any]]) -> list[str]:
    if not ups:
        return []
    newest = ups[-1]
    which = f" (the newest of {len(ups)} starts)" if len(ups) > 1 else ""
    engine, warm = _fmt(newest["engine_s"], ".1f"), _fmt(newest["warmup_s"], ".1f")
    return [f"start-up  engine {engine} s, warm-up {warm} s before step {newest['step']}{which}"]


def _calibration_lines(r: dict[str, Any]) -> list[str]:
    """The online calibration's story (app/profiling/calibration_log.py), or nothing without a fit."""
    fit = r.get("calibration")
    if fit is None:
        return []
    steps = fit["steps"]
    return [f"profile   {fit['fits']} online fit(s), the newest from steps {steps[0]}-{steps[-1]}: "
            f"{describe_factors(fit['factors'])}",
            f"          predicted vs measured step time: {_fmt(_pct(fit['step_error_first']), '.0f')}% off "
            f"over the first steps, {_fmt(_pct(fit['step_error_last']), '.0f')}% over the last"]


def _profile_note(r: dict[str, Any]) -> str:
    """` (profile predicted 0.120 s)`, with `: stale` when off by more than 30%; "" when not recorded."""
    if r.get("predicted_step_s_median") is None:
        return ""
    ratio = r.get("profile_ratio")
    stale = ratio is not None and abs(ratio - 1) > STALE_TOLERANCE
    return f" (profile predicted {_fmt(r['predicted_step_s_median'])} s{': stale' if stale else ''})"


def _lr_lines(r: dict[str, Any]) -> list[str]:
    """The learning rate's first, peak and last value and its curve (none for a run without `lr`)."""
    lrs = _values(r["history"], "lr")
    if not lrs:
        return []
    return [f"lr        {_fmt(r['lr_first'])} -> {_fmt(r['lr_last'])} (max {_fmt(r['lr_max'])})",
            f"          {sparkline(lrs)}"]


def _health_lines(r: dict[str, Any]) -> list[str]:
    """Non-finite steps, loss spikes and why the run stopped: nothing when there is none."""
    lines = []
    if r["nonfinite_steps"]:
        lines.append(f"non-finite steps {_step_list(r['nonfinite_steps'])}: loss or gradient norm inf/NaN, "
                     "their updates were not applied")
    if r["loss_spikes"]:
        spikes = ", ".join(f"step {s['step']}: {s['loss']:.4g} (median {s['median']:.4g})"
                           for s in r["loss_spikes"][:5])
        more = f" and {len(r['loss_spikes']) - 5} more" if len(r["loss_spikes"]) > 5 else ""
        lines.append(f"loss spikes > {LOSS_SPIKE_FACTOR:g}x the running median: {spikes}{more}")
    if r["stopped"]:
        lines.append(f"stopped   {r['stopped']}")
    return lines


def _step_list(steps: list[int], most: int = 10) -> str:
    shown = ", ".join(map(str, steps[:most]))
    return shown + (f" and {len(steps) - most} more" if len(steps) > most else "")


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """PNG: loss and tokens/s over steps, and every rank's compute (busy) seconds over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history = report["history"]
    steps = [int(h["step"]) for h in history]
    fig, (loss_ax, rate_ax, busy_ax) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss_ax.plot(steps, [h.get("loss") for h in history], marker=".", label="loss")
    evals = [(int(h["step"]), h["eval_loss"]) for h in history if h.get("eval_loss") is not None]
    if evals:
        loss_ax.plot(*zip(*evals, strict=True), marker="o", label="eval_loss")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    rate_ax.plot(steps, [h.get("tokens_per_s") for h in history], marker=".")
    rate_ax.set_ylabel("tokens/s")
    ranks = max((len(h.get("rank_compute_s") or []) for h in history), default=0)
    for rank in range(ranks):
        points = [(int(h["step"]), h["rank_compute_s"][rank]) for h in history
                  if len(h.get("rank_compute_s") or []) > rank and h["rank_compute_s"][rank] is not None]
        if points:
            busy_ax.plot(*zip(*points, strict=True), marker=".", label=f"rank {rank}")
    busy_ax.set_ylabel("busy (compute) s")
    busy_ax.set_xlabel("step")
    busy_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ranks:
        busy_ax.legend(fontsize="small", ncol=min(ranks, 8))
    fig.suptitle(f"{report['name']} ({report['status']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
