"""`python -m app bench planner|compute|attention|train|step|peer|data`: planning latency, compute profile,
DACP overlap, measured training step time of the scheduling policies (`bench train`,
app/commands/bench_train.py), the training step's speed per config variant on one device (`bench step`,
app/commands/bench_step.py),
this project against TRL's SFTTrainer (`bench peer`, app/commands/bench_peer.py), tokenize throughput
against `datasets.map` (`bench data`, app/commands/bench_data.py).

`bench planner` times GDS + DACP (the skrull policy, weighing its baseline candidates as it does with
scheduling.calibration=online: scheduling/skrull.py) on one global batch of synthetic LMsysChat1M-like
lengths for (sequences, ranks) = (64, 8), (256, 32), (1024, 128), (4096, 1024), with CP = 8 (so DP =
ranks / 8) and Qwen2.5-0.5B's cost model with BucketSize 26000, every CP degree enabled
(scheduling.cp_degrees=auto, docs/design.md §13; `--two-level` plans with [1, N], the paper's DACP). Each
repeat plans a fresh batch (new seed), so the percentiles cover the data's variety, not one lucky batch.
"""

from __future__ import annotations

import argparse
import json
import time

from app.commands import bench_attention, bench_compute, bench_data, bench_peer, bench_step, bench_train

CASES = ((64, 8), (256, 32), (1024, 128), (4096, 1024))
CP_SIZE = 8
BUCKET_SIZE = 26000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    planner = sub.add_parser("planner", help="planning latency of GDS + DACP for one global batch")
    planner.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    planner.add_argument("--repeats", type=int, default=50, help="global batches planned per case")
    planner.add_argument("--two-level", action="store_true",
                         help="plan with cp_degrees [1, N] (the paper's DACP) instead of every power of two")
    planner.set_defaults(_bench=_run_planner)
    compute = sub.add_parser("compute", help="micro-batch compute time on one device, fitted to the profile")
    bench_compute.add_arguments(compute)  # stdlib-only at import: torch loads when it runs
    compute.set_defaults(_bench=bench_compute.run)
    attention = sub.add_parser("attention", help="DACP attention: local/ring overlap on CPU (gloo)")
    bench_attention.add_arguments(attention)  # stdlib-only at import: torch loads when it runs
    attention.set_defaults(_bench=bench_attention.run)
    train = sub.add_parser("train", help="measured step time of scheduling policies on the same global "
                                         "batches, interleaved in one Ray Train worker group")
    bench_train.add_arguments(train)  # stdlib-only at import: Ray, torch and DeepSpeed load when it runs
    train.set_defaults(_bench=bench_train.run)
    peer = sub.add_parser("peer", help="TRL's SFTTrainer vs this project (skrull, balanced_packed): same "
                                       "model, tokens and steps, run alternately; tokens/s and the ratios")
    bench_peer.add_arguments(peer)  # stdlib-only at import: each side runs in its own process
    peer.set_defaults(_bench=bench_peer.run)
    step = sub.add_parser("step", help="the training step of config variants, interleaved on one device "
                                       "(no Ray): tokens/s, MFU, micro-batch / optimizer / gap time, peak "
                                       "memory against the memory model")
    bench_step.add_arguments(step)  # stdlib-only at import: torch and DeepSpeed load when it runs
    step.set_defaults(_bench=bench_step.run)
    data = sub.add_parser("data", help="tokenize throughput: this pipeline at 1 task and every CPU vs "
                                       "datasets.map(num_proc=CPUs), same rows and tokenize function")
    bench_data.add_arguments(data)  # stdlib-only at import: Ray and datasets load when it runs
    data.set_defaults(_bench=bench_data.run)


def planner_latency(sequences: int, ranks: int, repeats: int, two_level: bool = False) -> dict[str, float]:
    """Median / p99 wall milliseconds of plan_step('skrull', ...) over `repeats` fresh batches, with every
    CP degree (or [1, N] with `two_level`)."""
    import numpy as np

    from scheduling import CostModel, plan_step, sample_lengths

    cost = CostModel.from_model_dims(hidden_size=896, kv_hidden_size=128, num_layers=24)
    limit = BUCKET_SIZE * CP_SIZE
    times = []
    for seed in range(repeats):
        lengths = np.minimum(sample_lengths("lmsys", sequences, seed), limit)
        start = time.perf_counter()
        plan_step("skrull", lengths, dp_size=ranks // CP_SIZE, cp_size=CP_SIZE, bucket_size=BUCKET_SIZE,
                  cost=cost, cp_degrees=[1, CP_SIZE] if two_level else "auto", baselines=True)
        times.append((time.perf_counter() - start) * 1e3)
    return {"sequences": sequences, "ranks": ranks, "dp_size": ranks // CP_SIZE, "cp_size": CP_SIZE,
            "plan_ms_median": float(np.median(times)), "plan_ms_p99": float(np.percentile(times, 99))}


def _run_planner(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    rows = [planner_latency(s, r, args.repeats, args.two_level) for s, r in CASES]
    if args.json:
        print(json.dumps({"planner": rows}))
        return 0
    degrees = f"[1, {CP_SIZE}]" if args.two_level else "auto"
    print(f"planner latency, skrull policy (GDS + DACP), CP={CP_SIZE}, BucketSize={BUCKET_SIZE}, "
          f"cp_degrees={degrees}, {args.repeats} batches per case")
    print(f"{'sequences':>9}  {'ranks':>5}  {'DPxCP':>7}  {'median ms':>9}  {'p99 ms':>8}")
    for row in rows:
        shape = f"{row['dp_size']}x{row['cp_size']}"
        print(f"{row['sequences']:>9}  {row['ranks']:>5}  {shape:>7}  {row['plan_ms_median']:>9.2f}  "
              f"{row['plan_ms_p99']:>8.2f}")
    return 0


def run(args: argparse.Namespace) -> int:
    return int(args._bench(args) or 0)
